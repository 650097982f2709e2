"""The worker gRPC server on a group leader: the engine on its own thread behind grpc.aio."""
