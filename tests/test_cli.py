import pytest

from entropy_rft.cli.main import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "erft" in out


def test_unknown_command_exits_nonzero():
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code != 0
