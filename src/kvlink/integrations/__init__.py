"""kvlink inside other serving engines. Each subpackage imports its engine; nothing else here does."""
