"""``celery outbox`` and ``outbox-celery`` offer the same commands, whenever they are defined."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest

from outbox_celery.cli import celery_outbox, cli


@pytest.fixture
def late_command() -> Iterator[str]:
    """A command added to ``cli`` after the module was imported; removed afterwards."""

    @cli.command("late-probe")
    def late_probe() -> None:
        """Defined after the celery subcommand was built."""

    yield "late-probe"
    cli.commands.pop("late-probe", None)


def test_every_cli_command_is_a_celery_outbox_command() -> None:
    assert celery_outbox.list_commands(click.Context(celery_outbox)) == cli.list_commands(click.Context(cli))


def test_a_command_defined_after_the_celery_group_is_not_dropped(late_command: str) -> None:
    assert celery_outbox.get_command(click.Context(celery_outbox), late_command) is cli.commands[late_command]
