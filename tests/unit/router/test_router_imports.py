import subprocess
import sys


def test_router_never_imports_torch():
    # A fresh interpreter: this test process may have torch loaded by other tests.
    code = (
        "import sys, kubesgl.router.app, kubesgl.router.cli, kubesgl.router.discovery;"
        "kubesgl.router.discovery.load_kube_connection;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
