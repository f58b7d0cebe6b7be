"""mkdocs hooks (see mkdocs.yml): the figures of experiments/results/ on the site.

The pages link them as `../experiments/results/NAME.png`, which works on GitHub but points
outside mkdocs' `docs_dir`. The hook adds the figures to the site as
`experiments/results/NAME.png` and points the top-level pages' links there.
"""

from pathlib import Path

from mkdocs.structure.files import File


RESULTS = Path(__file__).resolve().parent.parent / "experiments" / "results"


def on_files(files, config):
    for figure in sorted(RESULTS.glob("*.png")):
        files.append(
            File.generated(config, f"experiments/results/{figure.name}", abs_src_path=str(figure))
        )
    return files


def on_page_markdown(markdown, page, config, files):
    if "/" in page.file.src_uri:  # only pages at the top of docs/ link this way
        return markdown
    return markdown.replace("](../experiments/results/", "](experiments/results/")
