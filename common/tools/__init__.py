"""Commands that measure, read what runs wrote, or make data for them, each
run as `python -m common.tools.<name>`:

  bench            speed beside the plain reference (`make bench`); a package
                   whose modules each do one part of it (its __init__ lists
                   them); `python -m common.tools.bench.comm_bench` is one
                   process of an all-reduce measurement
  plots            figures from run directories and TensorBoard logs
  results          RESULTS.md from run directories and bench CSVs
  demo_data        the demo's digits, and ImageNet-shaped fake JPEGs
  filelist         a --file-list of the images a scan of a dataset finds
  export           a run's weights as safetensors, ONNX or TorchScript, with
                   a JSON card, checked against the checkpoint's model
  scaling          the scaling model of DDP training from 1 to 1,024 GPUs
  link_validation  Validation B of the scaling model: DDP over a link of
                   known bandwidth between two network namespaces (root)

They import only the bottom layer of common/ (errors, arguments, config,
hardware) and each other, except where they run the training stack: bench's
sections, its measured processes (measurements, comm_bench) and its
data-scale section, filelist, which writes what the training scripts' scan
finds, and export, which builds a run's model from its checkpoint. Training
never imports a tool.
"""
