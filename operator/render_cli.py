"""`kubesgl render -f FILE`: print the objects the operator would apply, as a YAML stream."""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from typing import Any

import yaml

from kubesgl.operator.render import render
from kubesgl.operator.validation import InvalidSpec, parse_inference_service


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


def read_documents(filename: str) -> list[Any]:
    """The YAML documents of a file, or of standard input for -; raises OSError or yaml.YAMLError."""
    with nullcontext(sys.stdin) if filename == "-" else open(filename) as stream:
        return [doc for doc in yaml.load_all(stream, Loader=_StrictLoader) if doc is not None]


def print_problems(prog: str, filename: str, document: dict[str, Any], error: InvalidSpec) -> None:
    metadata = document.get("metadata")  # anything YAML holds: the problems say what is wrong
    name = metadata.get("name") if isinstance(metadata, dict) else None
    named = isinstance(name, str) and name
    which = f"InferenceService {name}" if named else "InferenceService without metadata.name"
    print(f"{prog}: {filename}: {which}:", file=sys.stderr)
    for problem in error.problems:
        print(f"  {problem}", file=sys.stderr)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kubesgl render",
        description="Print the Kubernetes objects an InferenceService becomes (a YAML stream)."
        " Owner references appear only when the input has metadata.uid.",
    )
    parser.add_argument(
        "-f",
        "--filename",
        required=True,
        help="InferenceService YAML file, or - for standard input",
    )
    args = parser.parse_args(argv)
    try:
        documents = read_documents(args.filename)
    except (OSError, yaml.YAMLError) as error:
        print(f"kubesgl render: cannot read {args.filename}: {error}", file=sys.stderr)
        return 2
    if not documents:
        print(
            f"kubesgl render: {args.filename}: no InferenceService in it (no YAML document)",
            file=sys.stderr,
        )
        return 2
    objects = []
    for document in documents:
        if not isinstance(document, dict):
            print(f"kubesgl render: {args.filename}: a document is not a mapping", file=sys.stderr)
            return 2
        try:
            objects += render(parse_inference_service(document))
        except InvalidSpec as error:
            print_problems("kubesgl render", args.filename, document, error)
            return 2
    yaml.dump_all(objects, sys.stdout, Dumper=_Dumper, sort_keys=False)
    return 0
