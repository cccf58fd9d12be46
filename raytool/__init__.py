"""raytool: train tool-using LLM agents with RL (the ReTool recipe) as a Ray-native actor system.

This package is the pure-logic layer: nothing here imports Ray at module level (see actors/ for the
Ray layer). Every class can be built and tested in-process.
"""

__version__ = "0.1.0"
