"""The dashboard's built assets (`static/`: index.html, app.js, app.css, favicon.svg), made from
ui/ at the repository's root by `make ui` and committed, so that running atoll never needs npm.
No Python code: controlplane.ui_pages serves these files at /ui."""
