"""`kubesgl bench serving --base-url`: the server's root URL or its OpenAI base URL."""

from __future__ import annotations

import pytest

from kubesgl.bench.serving import build_parser


@pytest.mark.parametrize(
    "given",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",  # what `kubesgl up` prints as the OpenAI base URL
        "http://127.0.0.1:8000/v1/",
    ],
)
def test_the_base_url_is_the_servers_root_however_it_is_given(given):
    """The benchmark adds /v1/models, /model_info and /v1/completions to it: given the OpenAI
    base URL, it asked /v1/v1/models and stopped at the router's 404."""
    args = build_parser().parse_args(["--base-url", given])
    assert args.base_url == "http://127.0.0.1:8000"
