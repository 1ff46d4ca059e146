"""app: the `moco` command line and the Gradio search UI."""

__all__: list[str] = []
