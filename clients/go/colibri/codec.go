package colibri

import (
	"fmt"

	"google.golang.org/protobuf/proto"
)

// codec marshals messages with google.golang.org/protobuf (API v2), which
// the generated colibriv1 code is written for. gRPC's own "proto" codec goes
// through github.com/golang/protobuf, and when that is the table-driven
// v1.3 (Debian bookworm installs golang-github-golang-protobuf-1-3-dev for
// golang-google-grpc-dev) it panics on API v2 messages ("protobuf tag not
// enough fields"). Dial forces this codec on every call, so the client works
// with either. The name "proto" keeps the usual content-type,
// application/grpc+proto.
type codec struct{}

func (codec) Name() string { return "proto" }

func (codec) Marshal(v interface{}) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("colibri: cannot marshal %T: not a proto.Message", v)
	}
	return proto.Marshal(m)
}

func (codec) Unmarshal(data []byte, v interface{}) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("colibri: cannot unmarshal into %T: not a proto.Message", v)
	}
	return proto.Unmarshal(data, m)
}
