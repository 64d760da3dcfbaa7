"""Corpora of other kinds than the quickstart's, made from what a Linux machine with Python already holds (no
download), for measuring the training recipes on more than the text they were tuned on
(`bench_recipe.py --corpus NAME`). Each is one UTF-8 file of documents joined by `<|endoftext|>`, which
`scratchlm quickstart --text FILE` reads (about 5% of the documents held out).

    stdlib       the quickstart's own corpus: the standard library's .py files (code with English comments)
    docstrings   English technical prose: every docstring of the standard library (one document per module:
                 its docstrings, one paragraph each) and the language reference topics of `pydoc_data`
    man          English reference prose: the manual pages of sections 1, 5, 7 and 8 under /usr/share/man,
                 rendered to plain text by groff, without running header, footer and indentation (one page a
                 document, in sorted order, up to `--max-mb`)
    german       German: every translated message of the gettext catalogs under /usr/share/locale/de (one
                 message a line, 100 messages of a catalog a document; the programs' own translations, mostly
                 short sentences of interface text)
    translations the same from every language under /usr/share/locale but English, language after language in
                 sorted order of their codes (many scripts, many distinct words; 30 MB reach `hi`, Hindi)

    python benchmarks/corpora.py man /tmp/corpora/man.txt
"""

from __future__ import annotations

import argparse
import ast
import gettext
import gzip
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from scratchlm.data.corpus import stdlib_documents, stdlib_root
from scratchlm.tokenizer import END_OF_TEXT


def docstring_documents() -> Iterator[str]:
    for _, text in stdlib_documents():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, nodes)]
        docs = [d for d in docs if d and len(d.split()) >= 4]
        if docs:
            yield "\n\n".join(docs)
    topics_file = stdlib_root() / "pydoc_data" / "topics.py"
    topics: dict[str, str] = {}
    exec(compile(topics_file.read_text(encoding="utf-8"), str(topics_file), "exec"), {}, topics)
    yield from (text for _, text in sorted(topics["topics"].items()))


def man_documents(root: Path = Path("/usr/share/man")) -> Iterator[str]:
    pages = sorted(p for section in ("man1", "man5", "man7", "man8") for p in (root / section).glob("*.gz"))
    if not pages:
        raise SystemExit(f"no manual pages under {root}/man{{1,5,7,8}}")
    for page in pages:
        try:
            source = gzip.decompress(page.read_bytes())
        except (OSError, EOFError):
            continue
        if source.startswith(b".so "):  # a link to another page
            continue
        rendered = subprocess.run(
            ["groff", "-man", "-Tutf8", "-P-cbou", "-rLL=100n"],
            input=source,
            capture_output=True,
            timeout=30,
        )
        text = rendered.stdout.decode("utf-8", errors="replace")
        # Without the running header and footer, and without the page's indentation (7 columns for the
        # body, 0 for the section headings), so that the text reads as text.
        lines = [line.rstrip() for line in text.splitlines()[1:-1]]
        lines = [line[7:] if line.startswith(" " * 7) else line for line in lines]
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
        if rendered.returncode == 0 and len(text.split()) >= 50:
            yield text + "\n"


MESSAGES_PER_DOCUMENT = 100


def german_documents(root: Path = Path("/usr/share/locale/de/LC_MESSAGES")) -> Iterator[str]:
    catalogs = sorted(root.glob("*.mo"))
    if not catalogs:
        raise SystemExit(f"no gettext catalogs under {root}")
    for catalog in catalogs:
        try:
            with catalog.open("rb") as f:
                messages = gettext.GNUTranslations(f)._catalog  # msgid -> msgstr
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        lines = [
            " ".join(text.split())
            for key, text in sorted(messages.items(), key=lambda kv: str(kv[0]))
            if key and isinstance(text, str) and text.strip()
        ]
        # Documents of MESSAGES_PER_DOCUMENT messages, so that the held-out part is more than a few catalogs.
        for start in range(0, len(lines), MESSAGES_PER_DOCUMENT):
            yield "\n".join(lines[start : start + MESSAGES_PER_DOCUMENT]) + "\n"


def translation_documents(root: Path = Path("/usr/share/locale")) -> Iterator[str]:
    for language in sorted(root.iterdir()):
        catalogs = language / "LC_MESSAGES"
        if not language.name.startswith("en") and any(catalogs.glob("*.mo")):
            yield from german_documents(catalogs)


CORPORA: dict[str, Callable[[], Iterator[str]]] = {
    "stdlib": lambda: (text for _, text in stdlib_documents()),
    "docstrings": docstring_documents,
    "man": man_documents,
    "german": german_documents,
    "translations": translation_documents,
}


def write_corpus(name: str, out: Path, max_mb: float = 12.0) -> Path:
    """Write corpus `name` to `out` (documents joined by `<|endoftext|>`, at most `max_mb` MB)."""
    documents, size = [], 0
    for document in CORPORA[name]():
        if END_OF_TEXT in document:
            continue
        size += len(document.encode("utf-8")) + len(END_OF_TEXT)
        if size > max_mb * 1e6:
            break
        documents.append(document)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(END_OF_TEXT.join(documents), encoding="utf-8")
    print(f"{name}: {len(documents):,} documents, {out.stat().st_size / 1e6:.1f} MB -> {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=CORPORA)
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-mb", type=float, default=12.0, help="size cap of the file (default 12 MB)")
    args = parser.parse_args()
    write_corpus(args.name, args.out, args.max_mb)


if __name__ == "__main__":
    main()
