"""Analysis of trained SAEs: inference dumps, visuals, the splice evaluation, the summary, and comparisons."""
