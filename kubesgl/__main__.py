from kubesgl.cli import run

run()
