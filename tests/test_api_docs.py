"""The API reference builds (pdoc, as scripts/build_docs.sh runs it) and documents every public
name of ``fastpos.__all__`` with its docstring."""

from __future__ import annotations

import html
import os
import re
import subprocess

import fastpos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_api_reference_documents_every_public_name(tmp_path):
  out = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "build_docs.sh"), str(tmp_path / "api")],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env={**os.environ, "PYTHONPATH": ROOT},
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  page = (tmp_path / "api" / "fastpos.html").read_text(encoding="utf-8")
  for name in fastpos.__all__:
    section = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert section, f"fastpos.{name} is not in the API reference"
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", section.group(1))).split())
    obj = getattr(fastpos, name)
    if getattr(obj, "__name__", name) != name:  # another name of a public class: pdoc links it
      assert obj.__name__ in fastpos.__all__ and re.search(rf"\b{obj.__name__}\b", text), name
      continue
    words = " ".join(obj.__doc__.replace("`", "").split()[:3])
    assert words in text.replace(" ,", ","), f"fastpos.{name}: its docstring is not shown"
