"""``dpops key``: create a noise key and show its public id (never the key itself)."""

from __future__ import annotations

import click

from dpops.cli.common import HelpGroup, echo_ok, say
from dpops.noise.randomness import NoiseKey, convert_legacy_key_file


@click.group("key", cls=HelpGroup)
def cli() -> None:
    """Manage the secret noise key behind keyed (reproducible) noise."""


@cli.command("generate")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def generate(path: str, as_json: bool) -> None:
    """Write a new noise key file (``dpops-noise-key v1``: header, key id, 32 random bytes in hex) to PATH
    with mode 0600. Refuses to overwrite."""
    key = NoiseKey.generate(path)
    if as_json:
        echo_ok({"path": path, "key_id": key.key_id})
    else:
        say(f"wrote new noise key to {path} (key id {key.key_id}); keep it secret and backed up")


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


@cli.command("convert")
@click.argument("old", type=click.Path(dir_okay=False))
@click.argument("new", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(old: str, new: str, as_json: bool) -> None:
    """Rewrite the key file OLD of an older dpops (bare hex or base64 text) as a ``dpops-noise-key v1`` file
    NEW (mode 0600, never overwriting). The key and its id stay the same, so earlier runs stay reproducible.
    Then replace OLD with NEW where the key is mounted, and remove OLD."""
    key = convert_legacy_key_file(old, new)
    if as_json:
        echo_ok({"path": new, "key_id": key.key_id, "converted_from": old})
    else:
        say(f"wrote {new} (key id {key.key_id}, the same key as {old}); mount it in place of {old} and "
                   f"delete {old}")
