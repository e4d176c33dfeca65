"""Commands that read what runs wrote, or make data for them, run as
`python -m common.tools.<name>`: bench (speed beside the plain reference),
plots (figures from run directories and logs), results (RESULTS.md) and
demo_data (the demo's digits, ImageNet-shaped fake JPEGs). They import only
the bottom layer of common/ (errors, arguments), except bench, which runs
the training stack it measures.
"""
