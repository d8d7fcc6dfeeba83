// A reflection-only gRPC client, as grpcurl works without .proto files: it
// asks the server's reflection service for the file defining a service, builds
// the method's request from that descriptor (empty fields), calls the method
// and prints the response as JSON. Exits 1 naming the step that failed.
//
// Usage: reflection_client HOST:PORT package.Service/Method
package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	rpb "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// Marshals with the protobuf API v2, which dynamic messages need (Debian's
// github.com/golang/protobuf, behind gRPC's default codec, predates them).
type codecV2 struct{}

func (codecV2) Marshal(v interface{}) ([]byte, error) { return proto.Marshal(v.(proto.Message)) }
func (codecV2) Unmarshal(data []byte, v interface{}) error {
	return proto.Unmarshal(data, v.(proto.Message))
}
func (codecV2) Name() string { return "proto" }

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "reflection_client: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	if len(os.Args) != 3 || !strings.Contains(os.Args[2], "/") {
		fail("usage: reflection_client HOST:PORT package.Service/Method")
	}
	addr := os.Args[1]
	slash := strings.LastIndex(os.Args[2], "/")
	service, method := os.Args[2][:slash], os.Args[2][slash+1:]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, addr, grpc.WithInsecure(), grpc.WithBlock())
	if err != nil {
		fail("dial %s: %v", addr, err)
	}
	defer conn.Close()

	stream, err := rpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		fail("reflection stream: %v", err)
	}
	err = stream.Send(&rpb.ServerReflectionRequest{
		MessageRequest: &rpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: service}})
	if err != nil {
		fail("reflection request: %v", err)
	}
	resp, err := stream.Recv()
	if err != nil {
		fail("reflection response: %v", err)
	}
	if e := resp.GetErrorResponse(); e != nil {
		fail("describing %s: %s (code %d)", service, e.GetErrorMessage(), e.GetErrorCode())
	}
	// The files of the response, registered in dependency order.
	files := new(protoregistry.Files)
	pending := []*descriptorpb.FileDescriptorProto{}
	for _, raw := range resp.GetFileDescriptorResponse().GetFileDescriptorProto() {
		fd := new(descriptorpb.FileDescriptorProto)
		if err := proto.Unmarshal(raw, fd); err != nil {
			fail("decoding a file descriptor: %v", err)
		}
		pending = append(pending, fd)
	}
	for len(pending) > 0 {
		var next []*descriptorpb.FileDescriptorProto
		for _, fd := range pending {
			f, err := protodesc.NewFile(fd, files)
			if err != nil {
				next = append(next, fd)
				continue
			}
			if err := files.RegisterFile(f); err != nil {
				fail("registering %s: %v", fd.GetName(), err)
			}
		}
		if len(next) == len(pending) {
			fail("the server's descriptors for %s do not resolve (%d files left)", service, len(next))
		}
		pending = next
	}
	desc, err := files.FindDescriptorByName(protoreflect.FullName(service))
	if err != nil {
		fail("%s is not in the described files: %v", service, err)
	}
	sd, ok := desc.(protoreflect.ServiceDescriptor)
	if !ok {
		fail("%s is not a service", service)
	}
	md := sd.Methods().ByName(protoreflect.Name(method))
	if md == nil {
		fail("%s has no method %s", service, method)
	}
	in, out := dynamicpb.NewMessage(md.Input()), dynamicpb.NewMessage(md.Output())
	if err := conn.Invoke(ctx, "/"+service+"/"+method, in, out, grpc.ForceCodec(codecV2{})); err != nil {
		fail("calling %s/%s: %v", service, method, err)
	}
	text, err := protojson.Marshal(out)
	if err != nil {
		fail("printing the response: %v", err)
	}
	fmt.Println(string(text))
}
