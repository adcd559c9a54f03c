"""Apache Beam release pipeline (dpops core never imports this package)."""
