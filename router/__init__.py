"""kvscale.router: the prefix-affinity router (`kvscale router`) and `kvscale up`."""
