"""One launch of issue 36's 4K -> 1080p pipeline for Nsight Compute
(ncu --kernel-name image_pipeline -c 1 python3 bench/image_ncu.py)."""
import cupy as cp
import numpy as np

import cufuse.image as I

k4 = cp.asarray(np.random.default_rng(36).integers(0, 256, (2160, 3840, 3), dtype=np.uint8))
pipe = I.Pipeline().resize((1080, 1920)).normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), scale=1 / 255)
pipe(k4)
cp.cuda.Device().synchronize()
