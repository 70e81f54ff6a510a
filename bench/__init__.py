"""The lab: the harnesses that reproduce the repository's benchmark tables (`python -m bench quality|reproduce|scale`,
`python -m bench.gpu_check`), beside the results they wrote (bench/*.md, *.json, *.png). It runs from a checkout of
the repository, from its root, and reads the models and text in `../shared/data`; it is not installed with the
package (the wheel holds `compress` only). It imports the product (`compress.*`) like any user; nothing in
`compress` imports it. What a user measures on their own machine is `compress bench kernels|decode|eval`."""
