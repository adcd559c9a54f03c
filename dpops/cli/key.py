"""``dpops key``: create a noise key and show its public id (never the key itself)."""

from __future__ import annotations

import click

from dpops.cli.common import echo_ok
from dpops.randomness import NoiseKey


@click.group("key")
def cli() -> None:
    """Manage the secret noise key behind keyed (reproducible) noise."""


@cli.command("generate")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def generate(path: str, as_json: bool) -> None:
    """Write 32 random bytes (hex) to PATH with mode 0600. Refuses to overwrite."""
    key = NoiseKey.generate(path)
    if as_json:
        echo_ok({"path": path, "key_id": key.key_id})
    else:
        click.echo(f"wrote new noise key to {path} (key id {key.key_id}); keep it secret and backed up")


@cli.command("id")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def key_id(path: str, as_json: bool) -> None:
    """Check the key file PATH (owner, mode 0600, directory not writable by others, entropy) and print its
    public key id. The key itself is never printed."""
    key = NoiseKey.from_file(path)
    if as_json:
        echo_ok({"path": path, "key_id": key.key_id})
    else:
        click.echo(key.key_id)
