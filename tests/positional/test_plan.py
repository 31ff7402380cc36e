"""The plan of what runs (``fastpos.positional.compatibility.plan``): its verdicts and facts on
known cells, its refusals' messages, capabilities read from the schemes' declarations, and the
tables in docs/compatibility.md, printed from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastpos import positional
from fastpos.positional import compatibility
from fastpos.positional.compatibility import Setting, plan, refusal

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def test_the_docs_table_is_what_the_plan_prints(capsys):
  assert compatibility.main(["compatibility"]) == 0
  printed = capsys.readouterr().out
  assert printed == compatibility.report()
  text = DOC.read_text()
  assert text.split("-->\n\n", 1)[1] == printed, (
      "docs/compatibility.md is stale: regenerate its tables with "
      "`python -m fastpos.positional.compatibility`"
  )


@pytest.mark.parametrize(
    "kernel, schemes, setting, options, facts",
    [
        ("softmax", ["t5_bias"], Setting(causal=True), {}, dict(path="softmax", runs="whole")),
        # exp map, nothing weighing the keys: the causal scan keeps their running maximum
        ("sikf", ["fastrpb"], Setting(causal=True), {}, dict(key_scales=True, kv=())),
        ("sikf", ["fastrpb"], Setting(), {}, dict(key_scales=False)),  # bidirectional
        ("sikf", ["fastrpb"], Setting(causal=True, seq=2), {}, dict(key_scales=False)),
        ("sikf", ["permuteformer"], Setting(causal=True), {}, dict(key_scales=True)),  # r = 1
        (
            "sikf",
            ["permuteformer"],
            Setting(causal=True),
            {"permuteformer": {"decay": 0.9}},
            dict(key_scales=False, kv=("decay",)),
        ),
        ("elu1", ["rope"], Setting(causal=True), {}, dict(den_features=True, key_scales=False)),
        ("elu1", ["kernelized_rpe"], Setting(two_d=True), {}, dict(kv=("table",))),
        ("elu1", ["fastrpb"], Setting(attn_chunk=8), {}, dict(runs="chunks")),
        ("elu1", ["fastrpb"], Setting(causal=True, seq=4), {}, dict(runs="split", split=True)),
        ("elu1", ["fastrpb"], Setting(seq=None), {}, dict(runs=None)),
        ("elu1", [], Setting(causal=True, mode="fused"), {}, dict(algorithm="fused")),
        ("elu1", [], Setting(mode="chunk"), {}, dict(algorithm=None)),  # bidirectional
        ("favor", ["rope"], Setting(causal=True, decoding=True), {}, dict(runs="decoding")),
    ],
)
def test_plan_facts(kernel, schemes, setting, options, facts):
  p = plan(kernel, schemes, setting, options=options)
  assert p.kernel.name == kernel and p.schemes == tuple(schemes) and p.setting == setting
  assert {k: getattr(p, k) for k in facts} == facts


@pytest.mark.parametrize(
    "kernel, schemes, setting, needles",
    [
        ("elu1", ["t5_bias"], Setting(), ["'elu1' x positional scheme 't5_bias'", "softmax"]),
        ("softmax", ["fastrpb"], Setting(attn_chunk=4), ["attn_chunk=4", "attn_chunk=0"]),
        ("softmax", ["none"], Setting(seq=2), ["mesh.seq=2", "support the kernels elu1"]),
        ("elu1", ["fastrpb"], Setting(packed=True), ["'fastrpb'", "linear kernels with none"]),
        ("softmax", ["kernelized_rpe"], Setting(causal=True, memory=True), ["kernelized_rpe"]),
        ("elu1", [], Setting(causal=True, memory=True), ["softmax kernel", "'elu1'"]),
        ("softmax", [], Setting(decoding=True), ["causal"]),
        ("softmax", [], Setting(causal=True, two_d=True, decoding=True), ["1D"]),
        ("elu1", ["rope"], Setting(causal=True, mode="fused"), ["rope", "'chunk'"]),
        ("elu1", [], Setting(mode="fused"), ["causal", "'auto', 'chunk' or 'recurrent'"]),
        ("elu1", [], Setting(mode="fast"), ["'fast'", "'auto', 'chunk', 'recurrent', 'fused'"]),
        ("elu1", ["absolute"], Setting(), ["not among the schemes"]),
    ],
)
def test_refusals_name_the_bad_value_and_the_choices(kernel, schemes, setting, needles):
  options = {"absolute": {}} if schemes == ["absolute"] else None
  with pytest.raises(ValueError) as e:
    plan(kernel, schemes if options is None else [], setting, options=options)
  for needle in needles:
    assert needle in str(e.value), (needle, str(e.value))


def test_capabilities_are_the_schemes_declarations(monkeypatch):
  """A declared capability is all the plan needs: withdraw one and the verdict follows."""
  packed = Setting(causal=True, packed=True)
  assert refusal("elu1", ["rope"], packed) is None
  monkeypatch.setattr(positional.get_class("rope"), "packs", ("softmax",))
  assert "'rope'" in refusal("elu1", ["rope"], packed)
  assert refusal("softmax", ["rope"], packed) is None
  assert refusal("softmax", ["spe"], Setting(two_d=True)) == "'spe' has no 2D form"
  monkeypatch.setattr(positional.get_class("spe"), "supports_2d", True)
  assert refusal("softmax", ["spe"], Setting(two_d=True)) is None


def test_refusal_reasons_are_the_tables_notes():
  header, rows, reasons = compatibility.table(Setting(causal=True, packed=True))
  assert header == ["kernel", *positional.SCHEMES]
  cells = {(r[0], s): c for r in rows for s, c in zip(header[1:], r[1:])}
  assert cells["softmax", "t5_bias"] == "ok" and cells["elu1", "rope"] == "ok"
  note = int(cells["elu1", "fastrpb"][1:])
  assert reasons[note] == refusal("elu1", ["fastrpb"], Setting(causal=True, packed=True))
