// Command colibri-decode-example runs a toy decoding loop through a Colibri
// router over one ForwardStream and prints a checksum of every step's final
// hidden state. Its output is byte-identical to the C++ example's
// (clients/cpp), which makes it a cross-client check:
//
//	colibri-decode-example --router 127.0.0.1:50051 --steps 4 --routing lut
//
// Each step draws a token id and d_model hidden values from a splitmix64
// generator seeded with --seed, runs the layers in order adding each layer's
// output to the hidden state (the residual), and prints the FNV-1a 64-bit
// hash of the final float32 bytes (little-endian) and the bits of the first
// four values. Errors go to stderr with exit status 1.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"math"
	"os"

	"github.com/colibri-moe/colibri/clients/go/colibri"
)

func main() {
	// Bad flags exit 1 like every other error (the flag package's default is 2).
	flag.CommandLine.Init(os.Args[0], flag.ContinueOnError)
	router := flag.String("router", "", "router address HOST:PORT (required)")
	steps := flag.Int("steps", 4, "decoding steps")
	layers := flag.Int("layers", 0, "layers per step; 0 = all of the model's")
	seed := flag.Uint64("seed", 1, "seed of the token and hidden-state generator")
	routing := flag.String("routing", "lut", "routing mode: lut or gate")
	if err := flag.CommandLine.Parse(os.Args[1:]); err == flag.ErrHelp {
		os.Exit(0)
	} else if err != nil {
		os.Exit(1) // the flag package printed the error and the usage
	}
	if err := run(*router, *steps, *layers, *seed, *routing); err != nil {
		fmt.Fprintln(os.Stderr, "colibri-decode-example:", err)
		os.Exit(1)
	}
}

func run(router string, steps, layers int, seed uint64, routing string) error {
	if router == "" {
		return fmt.Errorf("--router is required")
	}
	if flag.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", flag.Arg(0))
	}
	var mode colibri.Routing
	switch routing {
	case "lut":
		mode = colibri.RoutingLUT
	case "gate":
		mode = colibri.RoutingGate
	default:
		return fmt.Errorf("--routing %q is not lut or gate", routing)
	}
	if steps < 0 {
		return fmt.Errorf("--steps %d is negative", steps)
	}
	ctx := context.Background()
	client, err := colibri.Dial(router, colibri.Options{})
	if err != nil {
		return err
	}
	defer client.Close()
	info, err := client.ModelInfo(ctx)
	if err != nil {
		return err
	}
	if layers == 0 {
		layers = int(info.NLayers)
	}
	if layers < 0 || layers > int(info.NLayers) {
		return fmt.Errorf("--layers %d is outside [0, %d]", layers, info.NLayers)
	}
	if info.VocabSize <= 0 || info.DModel <= 0 {
		return fmt.Errorf("router reports vocab_size %d, d_model %d", info.VocabSize, info.DModel)
	}
	fmt.Printf("model d_model %d layers %d experts %d top_k %d routing %s\n",
		info.DModel, layers, info.NExperts, info.TopK, routing)

	session, err := client.OpenSession(ctx)
	if err != nil {
		return err
	}
	rng := splitmix64{state: seed}
	hidden := make([]float32, info.DModel)
	for s := 0; s < steps; s++ {
		token := int32(rng.next() % uint64(info.VocabSize))
		for i := range hidden {
			hidden[i] = rng.value()
		}
		for layer := 0; layer < layers; layer++ {
			r, err := session.Forward(&colibri.ForwardArgs{
				Layer: layer, TokenIDs: []int32{token}, Hidden: hidden, Routing: mode,
			})
			if err != nil {
				return fmt.Errorf("step %d layer %d: %w", s, layer, err)
			}
			if len(r.Output) != len(hidden) {
				return fmt.Errorf("step %d layer %d: %d output values, want %d", s, layer, len(r.Output), len(hidden))
			}
			for i, v := range r.Output {
				hidden[i] += v
			}
		}
		fmt.Printf("step %d token %d fnv1a64 %016x first", s, token, fnv1a64(hidden))
		for i := 0; i < len(hidden) && i < 4; i++ {
			fmt.Printf(" %08x", math.Float32bits(hidden[i]))
		}
		fmt.Println()
	}
	return session.Close()
}

// splitmix64 is the generator both examples share.
type splitmix64 struct{ state uint64 }

func (g *splitmix64) next() uint64 {
	g.state += 0x9E3779B97F4A7C15
	z := g.state
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// value returns a float32 in [-1, 1): 2u - 1 for u uniform in [0, 1) with
// 24 random bits. The conversions keep every step a rounded float32 (no
// fused multiply-add).
func (g *splitmix64) value() float32 {
	u := float32(g.next()>>40) * float32(1.0/16777216.0)
	return float32(2*u) - 1
}

// fnv1a64 hashes the little-endian bytes of v.
func fnv1a64(v []float32) uint64 {
	h := uint64(0xcbf29ce484222325)
	var b [4]byte
	for _, x := range v {
		binary.LittleEndian.PutUint32(b[:], math.Float32bits(x))
		for _, c := range b {
			h ^= uint64(c)
			h *= 0x100000001b3
		}
	}
	return h
}
