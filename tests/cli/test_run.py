"""What `dropless train` says when it is interrupted: only what is true (issue 53 row 3)."""

from dropless.cli.run import what_is_saved


def test_no_resume_advice_without_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    said = what_is_saved(str(tmp_path))
    assert "nothing to resume" in said and "--resume" not in said
    assert "nothing to resume" in what_is_saved(str(tmp_path / "never-created"))


def test_the_newest_checkpoint_is_named(tmp_path):
    for name in ("3", "12", "7.orbax-checkpoint-tmp-1"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    said = what_is_saved(str(tmp_path))
    assert "step 12" in said and f"--out-dir {tmp_path} --resume" in said
