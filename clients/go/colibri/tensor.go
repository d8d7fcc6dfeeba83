package colibri

import (
	"encoding/binary"
	"fmt"
	"math"

	pb "github.com/colibri-moe/colibri/clients/go/colibriv1"
)

// PackF32 returns a DATA_TYPE_F32 tensor holding data (little-endian) with
// the given shape, or shape [len(data)] when none is given. The caller must
// pass a shape whose product is len(data); the router refuses others.
func PackF32(data []float32, shape ...int64) *pb.Tensor {
	b := make([]byte, 4*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_F32, Shape: shapeOf(data, shape), Data: b}
}

// PackBF16 returns a DATA_TYPE_BF16 tensor holding data rounded to bfloat16
// (nearest, ties to even; NaN stays NaN, infinities stay infinite), with the
// given shape or [len(data)].
func PackBF16(data []float32, shape ...int64) *pb.Tensor {
	b := make([]byte, 2*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint16(b[2*i:], f32ToBF16(v))
	}
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BF16, Shape: shapeOf(data, shape), Data: b}
}

// Unpack returns the elements of an f32, bf16 or f16 tensor as float32, in
// row-major order. It fails when the dtype is none of those, a dimension is
// negative, or len(t.Data) is not exactly product(shape) * element size.
func Unpack(t *pb.Tensor) ([]float32, error) {
	if t == nil {
		return nil, fmt.Errorf("tensor is missing")
	}
	var size int
	switch t.Dtype {
	case pb.DataType_DATA_TYPE_F32:
		size = 4
	case pb.DataType_DATA_TYPE_BF16, pb.DataType_DATA_TYPE_F16:
		size = 2
	default:
		return nil, fmt.Errorf("tensor dtype %v is not f32, bf16 or f16", t.Dtype)
	}
	n := int64(1)
	for i, d := range t.Shape {
		if d < 0 {
			return nil, fmt.Errorf("tensor shape[%d] = %d is negative", i, d)
		}
		if d != 0 && n > math.MaxInt32/d {
			return nil, fmt.Errorf("tensor shape %v is too large", t.Shape)
		}
		n *= d
	}
	if int64(len(t.Data)) != n*int64(size) {
		return nil, fmt.Errorf("tensor data has %d bytes; shape %v of %v needs %d",
			len(t.Data), t.Shape, t.Dtype, n*int64(size))
	}
	out := make([]float32, n)
	b := t.Data
	for i := range out {
		switch t.Dtype {
		case pb.DataType_DATA_TYPE_F32:
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		case pb.DataType_DATA_TYPE_BF16:
			out[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[2*i:])) << 16)
		default:
			out[i] = f16ToF32(binary.LittleEndian.Uint16(b[2*i:]))
		}
	}
	return out, nil
}

func shapeOf(data []float32, shape []int64) []int64 {
	if len(shape) == 0 {
		return []int64{int64(len(data))}
	}
	return append([]int64(nil), shape...)
}

// f32ToBF16 rounds to nearest, ties to even; a NaN keeps its sign and gets
// the quiet bit so that truncation cannot turn it into an infinity.
func f32ToBF16(v float32) uint16 {
	bits := math.Float32bits(v)
	if v != v {
		return uint16(bits>>16) | 0x0040
	}
	bits += 0x7FFF + (bits>>16)&1
	return uint16(bits >> 16)
}

// f16ToF32 widens an IEEE binary16 value exactly (subnormals, infinities and
// NaN payloads included).
func f16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1F
	man := uint32(h & 0x3FF)
	switch {
	case exp == 0x1F: // infinity or NaN
		return math.Float32frombits(sign | 0x7F800000 | man<<13)
	case exp != 0: // normal
		return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
	case man == 0: // zero
		return math.Float32frombits(sign)
	}
	// Subnormal: man * 2^-24, exact in binary32.
	v := float32(man) * (1.0 / 16777216.0)
	if sign != 0 {
		v = -v
	}
	return v
}
