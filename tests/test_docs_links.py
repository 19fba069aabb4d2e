"""The user documentation's links: every relative link in README.md, docs/ and examples/ names a
file of the repository and, where it has an anchor, a heading of that file (GitHub's slugs);
every results file under benchmarks/results is cited by a document or by a cited JSON (the
results keep only what the docs cite)."""

import glob
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted(
  [os.path.join(REPO, "README.md")]
  + glob.glob(os.path.join(REPO, "docs", "*.md"))
  + glob.glob(os.path.join(REPO, "examples", "*.md"))
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading: lower case, punctuation but - and _ dropped,
  spaces as hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
  with open(path, encoding="utf-8") as fh:
    return {slug(line.lstrip("#")) for line in fh if line.startswith("#")}


def test_slugs_follow_github():
  assert slug(" Decode X·U·V (`xuv_decode.py`)") == "decode-xuv-xuv_decodepy"
  assert slug("The small ops in the kernels") == "the-small-ops-in-the-kernels"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve(doc):
  with open(doc, encoding="utf-8") as fh:
    text = fh.read()
  bad = []
  for target in LINK.findall(text):
    if target.startswith(("http://", "https://", "mailto:")):
      continue
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
    if not os.path.exists(full):
      bad.append(f"{target}: no such file")
    elif anchor and full.endswith(".md") and anchor not in anchors(full):
      bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(full, REPO)}")
  assert not bad, bad


def test_every_results_file_is_cited():
  results = os.path.join(REPO, "benchmarks", "results")
  cited = set()
  for doc in DOCS:
    with open(doc, encoding="utf-8") as fh:
      cited |= set(re.findall(r"results/([\w\-./]+\.json)", fh.read()))
  for name in list(cited):  # a cited JSON may name the files it was built from
    path = os.path.join(results, name)
    if os.path.exists(path):
      with open(path, encoding="utf-8") as fh:
        cited |= {
          os.path.normpath(os.path.join(os.path.dirname(name), n))
          for n in re.findall(r'"([\w\-./]+\.json)"', fh.read())
        }
  files = [
    os.path.relpath(p, results)
    for p in glob.glob(os.path.join(results, "**", "*.json"), recursive=True)
  ]
  uncited = sorted(f for f in files if f not in cited)
  assert files and not uncited, uncited
  # a plot sits beside the JSON it draws
  plots = glob.glob(os.path.join(results, "**", "*.png"), recursive=True)
  assert all(os.path.exists(p[: -len(".png")] + ".json") for p in plots), plots


def test_no_file_is_labelled_by_a_development_session():
  """Measurements are labelled by the lease (its UTC start) and call that made them, code and
  docs by what they do: no tracked file names a numbered development session."""
  tracked = subprocess.run(
    ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=False
  ).stdout.split()
  if not tracked:
    pytest.skip("not a git checkout")
  label = re.compile(r"\bsessions? \d+", re.IGNORECASE)
  hits = []
  for name in tracked:
    if not name.endswith((".py", ".md", ".json", ".txt", ".toml", ".cc", ".h", ".cfg")):
      continue
    with open(os.path.join(REPO, name), encoding="utf-8", errors="replace") as fh:
      hits += [f"{name}: {m.group(0)}" for m in label.finditer(fh.read())]
  assert not hits, hits[:10]


def test_results_files_named_in_results_exist():
  """A results JSON's notes name other results files that exist, or say they were not kept."""
  results = os.path.join(REPO, "benchmarks", "results")
  missing = []
  for path in glob.glob(os.path.join(results, "**", "*.json"), recursive=True):
    with open(path, encoding="utf-8") as fh:
      text = fh.read()
    for m in re.finditer(r"results/([\w\-./]+\.json)( \(not kept\))?", text):
      if not m.group(2) and not os.path.exists(os.path.join(results, m.group(1))):
        missing.append(f"{os.path.relpath(path, results)} names {m.group(1)}")
  assert not missing, missing
