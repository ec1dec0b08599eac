import purerpc
import shard.v1.shard_pb2 as shard_dot_v1_dot_shard__pb2


class ShardServicer(purerpc.Servicer):
    async def GetCapabilities(self, input_message):
        raise NotImplementedError()

    async def Health(self, input_message):
        raise NotImplementedError()

    async def Session(self, input_messages):
        raise NotImplementedError()

    async def Cancel(self, input_message):
        raise NotImplementedError()

    async def Release(self, input_message):
        raise NotImplementedError()

    async def GetMetrics(self, input_message):
        raise NotImplementedError()

    async def Return(self, input_message):
        raise NotImplementedError()

    async def Tokenize(self, input_message):
        raise NotImplementedError()

    async def Embed(self, input_message):
        raise NotImplementedError()

    async def GroupSteps(self, input_messages):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "shard.v1.Shard"
        )
        service_obj.add_method(
            "GetCapabilities",
            self.GetCapabilities,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.GetCapabilitiesRequest,
                shard_dot_v1_dot_shard__pb2.GetCapabilitiesResponse,
            )
        )
        service_obj.add_method(
            "Health",
            self.Health,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.HealthRequest,
                shard_dot_v1_dot_shard__pb2.HealthResponse,
            )
        )
        service_obj.add_method(
            "Session",
            self.Session,
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                shard_dot_v1_dot_shard__pb2.SessionRequest,
                shard_dot_v1_dot_shard__pb2.SessionResponse,
            )
        )
        service_obj.add_method(
            "Cancel",
            self.Cancel,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.CancelRequest,
                shard_dot_v1_dot_shard__pb2.CancelResponse,
            )
        )
        service_obj.add_method(
            "Release",
            self.Release,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.ReleaseRequest,
                shard_dot_v1_dot_shard__pb2.ReleaseResponse,
            )
        )
        service_obj.add_method(
            "GetMetrics",
            self.GetMetrics,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.GetMetricsRequest,
                shard_dot_v1_dot_shard__pb2.GetMetricsResponse,
            )
        )
        service_obj.add_method(
            "Return",
            self.Return,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.ReturnRequest,
                shard_dot_v1_dot_shard__pb2.ReturnResponse,
            )
        )
        service_obj.add_method(
            "Tokenize",
            self.Tokenize,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.TokenizeRequest,
                shard_dot_v1_dot_shard__pb2.TokenizeResponse,
            )
        )
        service_obj.add_method(
            "Embed",
            self.Embed,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.EmbedRequest,
                shard_dot_v1_dot_shard__pb2.EmbedResponse,
            )
        )
        service_obj.add_method(
            "GroupSteps",
            self.GroupSteps,
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                shard_dot_v1_dot_shard__pb2.GroupStepRequest,
                shard_dot_v1_dot_shard__pb2.GroupStepResponse,
            )
        )
        return service_obj


class ShardStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "shard.v1.Shard",
            channel
        )
        self.GetCapabilities = self._client.get_method_stub(
            "GetCapabilities",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.GetCapabilitiesRequest,
                shard_dot_v1_dot_shard__pb2.GetCapabilitiesResponse,
            )
        )
        self.Health = self._client.get_method_stub(
            "Health",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.HealthRequest,
                shard_dot_v1_dot_shard__pb2.HealthResponse,
            )
        )
        self.Session = self._client.get_method_stub(
            "Session",
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                shard_dot_v1_dot_shard__pb2.SessionRequest,
                shard_dot_v1_dot_shard__pb2.SessionResponse,
            )
        )
        self.Cancel = self._client.get_method_stub(
            "Cancel",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.CancelRequest,
                shard_dot_v1_dot_shard__pb2.CancelResponse,
            )
        )
        self.Release = self._client.get_method_stub(
            "Release",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.ReleaseRequest,
                shard_dot_v1_dot_shard__pb2.ReleaseResponse,
            )
        )
        self.GetMetrics = self._client.get_method_stub(
            "GetMetrics",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.GetMetricsRequest,
                shard_dot_v1_dot_shard__pb2.GetMetricsResponse,
            )
        )
        self.Return = self._client.get_method_stub(
            "Return",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.ReturnRequest,
                shard_dot_v1_dot_shard__pb2.ReturnResponse,
            )
        )
        self.Tokenize = self._client.get_method_stub(
            "Tokenize",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.TokenizeRequest,
                shard_dot_v1_dot_shard__pb2.TokenizeResponse,
            )
        )
        self.Embed = self._client.get_method_stub(
            "Embed",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                shard_dot_v1_dot_shard__pb2.EmbedRequest,
                shard_dot_v1_dot_shard__pb2.EmbedResponse,
            )
        )
        self.GroupSteps = self._client.get_method_stub(
            "GroupSteps",
            purerpc.RPCSignature(
                purerpc.Cardinality.STREAM_STREAM,
                shard_dot_v1_dot_shard__pb2.GroupStepRequest,
                shard_dot_v1_dot_shard__pb2.GroupStepResponse,
            )
        )