"""File formats, one module (or package) each: constants, reader and writer side by side."""
