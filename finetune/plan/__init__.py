"""`finetune plan` and `finetune check`: what a recipe needs per GPU before anything loads, from the shape of the
run (`shape`), each piece's estimate (`estimates`) and the lines that give the verdict (`verdict`), with the
FLOPs a token costs (`flops`).

May import: `export`, `objectives`, `rollouts`, `model`, `storage`, `data`, `engine`, `config`, `errors`.
"""
