"""Builds the one native helper (memory ordering and futex waits); everything else is Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kalos._native",
            sources=["src/kalos/_native.c"],
            extra_compile_args=["-O2", "-std=c11"],
        )
    ]
)
