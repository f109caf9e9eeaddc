import json

from dropless.data import main


def test_prepare_command(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "b.jsonl").write_text('{"text": "world"}\n{"text": "again"}\n')
    out = tmp_path / "out"
    assert (
        main(
            [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out", str(out), "--no-progress"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"prepared {out}: byte tokenizer, vocab 258, uint16" in printed
    assert "tokens/byte" in printed and "train" in printed and "eval" in printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["documents"] + meta["eval"]["documents"] == 3

    args = [str(tmp_path / "a.txt"), "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "300"]
    assert main([*args, "--no-progress"]) == 2  # out exists
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: output directory" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert main([*args, "--no-progress", "--overwrite"]) == 0
    assert "bpe tokenizer" in capsys.readouterr().out

    assert main([str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o2")]) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
