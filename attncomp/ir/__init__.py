"""The IR: types and symbolic dims, ops, module, printer, parser, verifier, interpreter."""
