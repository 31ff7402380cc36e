"""benchmarks/memory_length.py: the memory-against-N table of softmax against linear attention +
FastRPB, on a 1-layer width-32 model (compiled only)."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory_length


@pytest.mark.slow  # four train-step compiles (~40 s on 2 cores); the flags' checks stay default
def test_softmax_memory_grows_faster_than_linear_fastrpb(tmp_path, capsys):
  code = memory_length.main(
      ["--smoke", "--rows=softmax,elu1_fastrpb", "--lengths=256,1024", "--batch=2"]
      + [f"--out={tmp_path}", f"--figure={tmp_path / 'fig.png'}"]
  )
  record = json.loads((tmp_path / "memory_length.json").read_text())
  by = {(r["row"], r["length"]): r["bytes"] for r in record["records"]}
  ratio = by[("softmax", 1024)] / by[("elu1_fastrpb", 1024)]
  assert code == (0 if ratio >= memory_length.GOAL_RATIO else 1)  # the goal decides the code
  # Softmax holds an N x N score matrix per head: 4x the tokens cost it more than 4x the
  # bytes; the linear model's bytes grow about linearly (its parameters do not grow).
  assert by[("softmax", 1024)] / by[("softmax", 256)] > 4
  assert by[("elu1_fastrpb", 1024)] / by[("elu1_fastrpb", 256)] < 4
  assert by[("softmax", 1024)] > by[("elu1_fastrpb", 1024)]
  text = (tmp_path / "memory_length.md").read_text()
  assert "| ELU+1 + absolute + FastRPB |" in text and "softmax's bytes over the row's" in text
  verdict = "PASS" if ratio >= memory_length.GOAL_RATIO else "FAIL"
  assert f"at N=1024 >= 10x (FastRPB's Figure 3a: up to 10x) | {ratio:.2f}x | {verdict} |" in text
  assert (tmp_path / "fig.png").stat().st_size > 0
  capsys.readouterr()


def test_bad_flags_are_one_line_before_any_compile(capsys):
  assert memory_length.main(["--rows=softmax,nope"]) == 2
  assert "unknown nope; valid: softmax, sikf_fastrpb, elu1_fastrpb" in capsys.readouterr().err
  assert memory_length.main(["--lengths=0,12"]) == 2
  assert "--lengths='0,12': give increasing positive integers" in capsys.readouterr().err
