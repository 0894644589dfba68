"""The build <-> runtime contract: what the compiler writes and the runtime reads.

The plan (:mod:`.plan`), the manifest (:mod:`.manifest`), the bundle on disk (:mod:`.bundle`), the
activation table (:mod:`.activations`), Track B's launch plans (:mod:`.launch_plan`) and the target
rules (:mod:`.arch`). Nothing here imports onnx, onnxruntime, the IREE compiler or the compiler
package: the runtime stands on this ground alone.
"""
