"""A screenshot of a report.html with one token hovered (docs/viewer.png): the distribution's Chromium driven by
Playwright, as tests/test_viewer.py drives it.

    python scripts/viewer_screenshot.py diag/report.html docs/viewer.png [--width 1100 --height 760]

The token hovered is the worst of the worst sequence (largest |log ρ|); the PNG is quantised to 64 colours
(Pillow) to keep it small.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="a report.html (diagnose) or a run's report.html (offpolicy view)")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=760)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()

    from PIL import Image
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.goto(args.page.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']")
        worst = page.evaluate("""() => {
            const seq = document.querySelector('#seqs .seq');
            let best = null, top = -1;
            seq.querySelectorAll('.tok').forEach((s) => {
                const a = parseFloat(getComputedStyle(s).backgroundColor.split(',')[3] || '0');
                if (a > top) { top = a; best = Number(s.dataset.t); }
            });
            return best; }""")
        page.hover(f"#seqs .seq:first-of-type .tok[data-t='{worst}']")
        png = page.screenshot()
        browser.close()
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=64)
    image.save(args.out, optimize=True)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
