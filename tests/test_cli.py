"""The command line's own handling of what it is given (issue 40, finding 10): an old spelling of a renamed option
(``--versus-tp 3``, before ``--versus tp=3``) is refused with the new spelling, not argparse's bare "unrecognized
arguments"."""

import pytest

from harness.cli import main


@pytest.mark.parametrize("args, new", [
    (["--versus-tp", "3"], "use --versus tp=3"),
    (["--versus-dp=2"], "use --versus dp=2"),
    (["--versus-ep", "4", "--no-oracle"], "use --versus ep=4"),
    (["--versus-impl", "recipe"], "use --versus impl=recipe"),
    (["--versus-tp"], "use --versus tp=VALUE"),
])
def test_an_old_spelling_of_a_renamed_option_names_the_new_one(capsys, args, new):
    with pytest.raises(SystemExit) as raised:
        main(["compare", "kimi_rmsnorm", *args])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert f"{args[0].partition('=')[0]} was renamed: {new}" in error, error
    assert "unrecognized arguments" not in error
