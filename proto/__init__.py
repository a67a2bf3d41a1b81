"""Wire protocol of hybridpd: `hybridpd.proto` and its generated stubs (`scripts/gen_proto.sh`).

    from hybridpd.proto import hybridpd_pb2, hybridpd_pb2_grpc
"""
