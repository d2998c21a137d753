"""The job kinds the operator serves: what differs between them (``kind.JobKind``), the
PyTorchJob and TrainJob kinds, and which kind an object or pod belongs to (``registry``).
Pure."""
