"""`kubesgl render -f FILE ...`: print the objects the operator would apply, as a YAML stream."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, NamedTuple

import yaml

from kubesgl.cli_help import CommandParser
from kubesgl.operator.render import Object, render
from kubesgl.operator.spec import API_GROUP, KIND
from kubesgl.operator.validation import InvalidSpec, parse_inference_service, spec_warnings


class _Dumper(yaml.SafeDumper):
    """Writes repeated values out in full: anchors and aliases confuse readers of manifests."""

    def ignore_aliases(self, data: object) -> bool:
        return True


class _StrictLoader(yaml.SafeLoader):
    """Refuses a key given twice in one mapping, as kubectl does: PyYAML keeps the last, which
    silently turns two files pasted together without `---` into a mix of both."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"key {key!r} given", seen[key].start_mark, "and again", key_node.start_mark
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


# What `kubesgl render` and `kubesgl up` say of a file that read_documents finds empty.
NO_DOCUMENT = f"no {KIND} in it (no YAML document)"


# What read_documents raises for a file it cannot read (a ValueError: not UTF-8, or bad JSON).
READ_ERRORS = (OSError, ValueError, yaml.YAMLError)


def read_documents(filename: str) -> list[Any]:
    """The YAML documents of a file, or of standard input for -; a .json file is read as JSON,
    which YAML does not take when indented with tabs. Raises one of READ_ERRORS."""
    with nullcontext(sys.stdin) if filename == "-" else open(filename, encoding="utf-8") as stream:
        if filename.endswith(".json"):
            text = stream.read()
            return [json.loads(text, object_pairs_hook=_unique_keys)] if text.strip() else []
        return [doc for doc in yaml.load_all(stream, Loader=_StrictLoader) if doc is not None]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused with a key given twice (as _StrictLoader refuses one in YAML)."""
    keys = [key for key, _ in pairs]
    if twice := next((key for key in keys if keys.count(key) > 1), None):
        raise ValueError(f"key {twice!r} given twice in one object")
    return dict(pairs)


def _name_of(document: dict[str, Any]) -> str:
    metadata = document.get("metadata")  # anything YAML holds: the problems say what is wrong
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) and name else "without metadata.name"


def print_problems(prog: str, filename: str, document: dict[str, Any], error: InvalidSpec) -> None:
    print(f"{prog}: {filename}: {KIND} {_name_of(document)}:", file=sys.stderr)
    for problem in error.problems:
        print(f"  {problem}", file=sys.stderr)


PROG = "kubesgl render"
# What -f DIR reads, as kubectl does: the folder's files of these suffixes, not its subfolders.
MANIFEST_SUFFIXES = (".json", ".yaml", ".yml")


def input_files(filename: str) -> list[str]:
    """The files one -f names: itself (- for standard input), or a folder's manifests in name
    order; raises OSError, also for a folder without any."""
    if filename == "-" or not os.path.isdir(filename):
        return [filename]
    paths = (os.path.join(filename, name) for name in sorted(os.listdir(filename)))
    files = [path for path in paths if path.endswith(MANIFEST_SUFFIXES) and os.path.isfile(path)]
    if not files:
        *others, last = MANIFEST_SUFFIXES
        raise OSError(f"no {', '.join(others)} or {last} file in it")
    return files


def list_items(document: Any) -> list[Any]:
    """The objects a document holds: a List's items (what `kubectl get -o yaml` prints for
    several objects; kubectl apply takes each), else the document itself."""
    kind = document.get("kind") if isinstance(document, dict) else None
    items = document.get("items") if isinstance(document, dict) else None
    if isinstance(kind, str) and kind.endswith("List") and isinstance(items, list):
        return [item for entry in items for item in list_items(entry)]
    return [document]


def other_kind(document: dict[str, Any]) -> str | None:
    """`apiVersion kind name` of an object that is not an InferenceService of ours (a file for
    kubectl apply often holds a Secret or a Namespace beside one), None for one to check as
    ours. Another group's kind of the same name (KServe's, serving.kserve.io) is another kind;
    one without a kind, or of no group, is checked as ours, whose problems name what is wrong."""
    kind, api_version = document.get("kind"), document.get("apiVersion")
    group = api_version.partition("/")[0] if isinstance(api_version, str) else ""
    if isinstance(kind, str) and (kind != KIND or ("/" in str(api_version) and group != API_GROUP)):
        return f"{api_version} {kind} {_name_of(document)}"
    return None


def skipped_as_other_kind(prog: str, verb: str, filename: str, obj: Any) -> bool:
    """Whether an object of a file is another kind than ours, said to be skipped if so."""
    other = other_kind(obj) if isinstance(obj, dict) else None
    if other is not None:
        print(
            f"{prog}: {filename}: skipped {other}: {prog} {verb} {API_GROUP} {KIND}s only",
            file=sys.stderr,
        )
    return other is not None


class Found(NamedTuple):
    filename: str  # the file it came from, for messages
    document: Any  # one object: a YAML document or a List's item


def _documents_of(given: str) -> Iterator[tuple[str, list[Any] | Exception]]:
    """Each file one -f names with its documents, or the error that kept it from being read."""
    try:
        files = input_files(given)
    except OSError as error:
        yield given, error
        return
    for filename in files:
        try:
            documents: list[Any] | Exception = read_documents(filename)
        except READ_ERRORS as error:
            documents = error
        yield filename, documents


def read_inputs(filenames: list[str]) -> tuple[list[Found], bool]:
    """Every object of the files -f names, in order, and whether all of them could be read
    (each problem is printed)."""
    found: list[Found] = []
    read = True
    for given in filenames:
        for filename, documents in _documents_of(given):
            if isinstance(documents, Exception):
                print(f"{PROG}: cannot read {filename}: {documents}", file=sys.stderr)
                read = False
            elif not documents and filename != given:  # a folder's empty file, as kubectl skips it
                print(f"{PROG}: {filename}: skipped: no YAML document", file=sys.stderr)
            elif not documents:
                print(f"{PROG}: {filename}: {NO_DOCUMENT}", file=sys.stderr)
                read = False
            else:
                found += [
                    Found(filename, obj) for document in documents for obj in list_items(document)
                ]
    return found, read


def render_inputs(found: list[Found]) -> tuple[list[Object], bool]:
    """The objects each InferenceService found becomes, in order, and whether every one was
    sound (each problem is printed). Objects of other kinds are skipped with a note."""
    objects: list[Object] = []
    sound = True
    # the file of each InferenceService rendered, by its namespace and name
    first_in: dict[tuple[str, str], str] = {}
    for filename, document in found:
        if not isinstance(document, dict):
            print(f"{PROG}: {filename}: a document is not a mapping", file=sys.stderr)
            sound = False
            continue
        if skipped_as_other_kind(PROG, "renders", filename, document):
            continue
        try:
            isvc = parse_inference_service(document)
        except InvalidSpec as error:
            print_problems(PROG, filename, document, error)
            sound = False
            continue
        key = (isvc.metadata.namespace, isvc.metadata.name)
        if key in first_in:
            # its objects would be printed twice, and the second copy applied over the first
            print(
                f"{PROG}: {filename}: {KIND} {'/'.join(key)} given twice "
                f"(first in {first_in[key]})",
                file=sys.stderr,
            )
            sound = False
            continue
        first_in[key] = filename
        for warning in spec_warnings(isvc):  # rendered all the same, as the operator applies it
            print(
                f"{PROG}: {filename}: {KIND} {'/'.join(key)}: warning: {warning.message}",
                file=sys.stderr,
            )
        objects += render(isvc)
    return objects, sound


def main(argv: list[str]) -> int:
    parser = CommandParser(
        prog=PROG,
        description="Print the Kubernetes objects InferenceServices become (a YAML stream)."
        " Owner references appear only when the input has metadata.uid.",
    )
    parser.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        help="a YAML or JSON file of InferenceServices (Lists of them too; other kinds are "
        "skipped), a folder of such files (its .json, .yaml and .yml files in name order), or - "
        "for standard input; give -f again for more, rendered in order",
    )
    args = parser.parse_args(argv)
    if args.filename.count("-") > 1:
        parser.error("-f - given twice: standard input is read once")
    found, read = read_inputs(args.filename)
    objects, sound = render_inputs(found)
    if read and sound and not objects:
        print(f"{PROG}: no {KIND} in the input", file=sys.stderr)
    if not (read and sound and objects):
        return 2  # nothing printed: a stream without some of the input's objects misleads
    yaml.dump_all(objects, sys.stdout, Dumper=_Dumper, sort_keys=False)
    return 0
