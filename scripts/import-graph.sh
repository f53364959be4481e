#!/usr/bin/env bash
# The project's package graph by layer (tests/unit/test_import_graph.py's LAYERS), lazy
# imports included, each arrow that runs up a layer marked; exit 1 if any does.
cd "$(dirname "$0")/.." && exec "${PYTHON:-.venv/bin/python}" tests/unit/test_import_graph.py
