"""Placeholder: being written."""
import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def main(a: argparse.Namespace) -> int:
    raise SystemExit("not implemented yet")
