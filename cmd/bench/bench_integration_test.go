//go:build integration

package main

// Go benchmarks of the same measurements as the bench tool, on the real
// stack and at small sizes, so `make bench-short` (part of `make test`)
// keeps the measurement code working. Figures for docs/benchmarks.md come
// from the tool (`make bench`), not from these.

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// shortImageMiB is the image size of the upload benchmarks here.
const shortImageMiB = 16

func benchCtx(b *testing.B) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	b.Cleanup(cancel)
	return ctx
}

func shortImage(b *testing.B, env teststack.Env) (benchutil.Image, string) {
	b.Helper()
	dir := filepath.Join(env.Dir, "bench")
	img, err := benchutil.EnsureImage(benchCtx(b), dir, shortImageMiB)
	if err != nil {
		b.Fatal(err)
	}
	return img, dir
}

// BenchmarkUpload runs each upload path once per op: the library's cold
// fetch (with verification), virsh vol-upload over qemu+ssh, cat | ssh.
func BenchmarkUpload(b *testing.B) {
	env := teststack.Require(b)
	ctx := benchCtx(b)
	img, dir := shortImage(b, env)
	srv, err := benchutil.ServeFile(img.Path)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { srv.Close() })
	wrapper, err := benchutil.SSHWrapper(env, dir)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("library", func(b *testing.B) {
		var up, ver time.Duration
		for b.Loop() {
			res, err := benchutil.LibraryFetch(ctx, env, "benchshort", "img", srv.URL, img.SHA256, true)
			if err != nil {
				b.Fatal(err)
			}
			if res.Bytes != img.Size {
				b.Fatalf("uploaded %d bytes, image has %d", res.Bytes, img.Size)
			}
			up += res.Upload
			ver += res.Verify
		}
		b.ReportMetric(benchutil.MBps(img.Size*int64(b.N), up.Seconds()), "upload-MB/s")
		b.ReportMetric(benchutil.MBps(img.Size*int64(b.N), ver.Seconds()), "verify-MB/s")
	})
	b.Run("virsh", func(b *testing.B) {
		var total time.Duration
		for b.Loop() {
			d, err := benchutil.VirshUpload(ctx, env, wrapper, img.Path, "bench-short-virsh")
			if err != nil {
				b.Fatal(err)
			}
			total += d
		}
		b.ReportMetric(benchutil.MBps(img.Size*int64(b.N), total.Seconds()), "MB/s")
	})
	b.Run("ssh", func(b *testing.B) {
		var total time.Duration
		for b.Loop() {
			d, err := benchutil.SSHCat(ctx, env, img.Path, filepath.Join(dir, "ssh-cat-short.out"))
			if err != nil {
				b.Fatal(err)
			}
			total += d
		}
		b.ReportMetric(benchutil.MBps(img.Size*int64(b.N), total.Seconds()), "MB/s")
	})
}

func shortKVM(b *testing.B, env teststack.Env) *benchutil.KVM {
	b.Helper()
	k, err := newKVM(benchCtx(b), env, "t")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(k.Close)
	return k
}

// BenchmarkControlPath measures one cache-hit Create, Get and Delete per op
// (the first Create, the cold base fetch, is outside the timer) and
// reports the RPCs each made.
func BenchmarkControlPath(b *testing.B) {
	env := teststack.Require(b)
	ctx := benchCtx(b)
	k := shortKVM(b, env)
	warm := k.Spec("warm", 0)
	if _, err := k.Counted.Create(ctx, warm); err != nil {
		b.Fatal(err)
	}
	if err := k.Counted.Delete(ctx, warm.Ref()); err != nil {
		b.Fatal(err)
	}
	var create, get, del opStats
	i := 0
	for b.Loop() {
		s := k.Spec("c", i)
		i++
		op, err := k.Measure(func(p *egressproxy.Client) error { _, err := p.Create(ctx, s); return err })
		if err != nil {
			b.Fatal(err)
		}
		create.add(op)
		op, err = k.Measure(func(p *egressproxy.Client) error { _, err := p.Get(ctx, s.Ref()); return err })
		if err != nil {
			b.Fatal(err)
		}
		get.add(op)
		op, err = k.Measure(func(p *egressproxy.Client) error { return p.Delete(ctx, s.Ref()) })
		if err != nil {
			b.Fatal(err)
		}
		del.add(op)
	}
	b.ReportMetric(med(create.rpcs), "create-RPCs")
	b.ReportMetric(med(get.rpcs), "get-RPCs")
	b.ReportMetric(med(del.rpcs), "delete-RPCs")
	b.ReportMetric(med(create.wallMS), "create-ms")
	b.ReportMetric(med(get.wallMS), "get-ms")
	b.ReportMetric(med(del.wallMS), "delete-ms")
}

// BenchmarkConcurrentGets runs 100 concurrent Gets of 3 powered-off
// instances per op, on kvm2's pooled connection and directly with
// go-libvirt (with and without kvm2's XML decoding).
func BenchmarkConcurrentGets(b *testing.B) {
	env := teststack.Require(b)
	ctx := benchCtx(b)
	k := shortKVM(b, env)
	var refs []egressproxy.Ref
	var doms []string
	for i := range 3 {
		s := k.Spec("g", i)
		if _, err := k.Plain.Create(ctx, s); err != nil {
			b.Fatal(err)
		}
		if err := k.Stop(ctx, s.Name); err != nil {
			b.Fatal(err)
		}
		refs = append(refs, s.Ref())
		doms = append(doms, k.DomainName(s.Name))
	}
	const n = 100
	b.Run("pooled", func(b *testing.B) {
		for b.Loop() {
			if _, err := benchutil.ConcurrentGets(ctx, k.Plain, refs, n); err != nil {
				b.Fatal(err)
			}
		}
	})
	for _, decode := range []bool{false, true} {
		name := "direct"
		if decode {
			name = "direct-decode"
		}
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				if _, err := benchutil.DirectGets(ctx, env, doms, n, decode); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkSquidProbe runs one round of 200 probes through the stack's
// Squid per op.
func BenchmarkSquidProbe(b *testing.B) {
	env := teststack.Require(b)
	ctx := benchCtx(b)
	sink, err := benchutil.NewSinkTarget()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { sink.Close() })
	const n = 200
	var wall time.Duration
	for b.Loop() {
		r := benchutil.ProbeThrough(ctx, env.SquidAddr, sink.Addr, n, 32)
		if r.Failed > 0 {
			b.Fatalf("%d of %d probes failed, first: %v", r.Failed, r.Probes, r.FirstFailure)
		}
		wall += r.Wall
	}
	b.ReportMetric(float64(n*b.N)/wall.Seconds(), "probes/s")
}

// BenchmarkRTT runs the rtt phase once per op at a small size (3 instances
// listed, 1 run of each operation), so `make bench-short` keeps it working.
func BenchmarkRTT(b *testing.B) {
	env := teststack.Require(b)
	ctx := benchCtx(b)
	for b.Loop() {
		res, err := runRTT(ctx, env, options{runs: 1, rttMS: 50, rttList: 3})
		if err != nil {
			b.Fatal(err)
		}
		if len(res.hit.rounds) != 1 || len(res.cold.rounds) != 1 || len(res.list.rounds) != 1 || res.seqRPCs != 1+2*3 {
			b.Fatalf("rtt result incomplete: %+v", res)
		}
		b.ReportMetric(res.hit.rounds[0], "hit-create-RTTs")
		b.ReportMetric(res.cold.rounds[0], "cold-create-RTTs")
		b.ReportMetric(res.list.rounds[0], "list-RTTs")
	}
}

// BenchmarkFanout runs the fanout phase's steps on the stack (two entries
// stand in for two hosts): both at once through one Fanout (one download),
// then a third entry going cold afterwards. On one host it never copies
// the others' bases over the network (a qcow2 one is not copied inside the
// host either): it downloads.
func BenchmarkFanout(b *testing.B) {
	env := teststack.Require(b)
	ctx := benchCtx(b)
	img, _ := shortImage(b, env)
	srv, err := benchutil.ServeFile(img.Path)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { srv.Close() })
	for i := 0; b.Loop(); i++ {
		var ts []fanoutTarget
		for j := range 3 {
			ts = append(ts, fanoutTarget{Env: env, Entry: fmt.Sprintf("benchfan%d%d", i, j)})
		}
		out, err := fanoutEnsure(ctx, ts[:2], srv.URL, img.SHA256, true)
		if err == nil {
			out, err = fanoutEnsure(ctx, ts, srv.URL, img.SHA256, true)
		}
		deleteEntries(ctx, env, ts)
		if err != nil {
			b.Fatal(err)
		}
		if s := out.Results[2].Source; s != imagecache.SourceMirror {
			b.Fatalf("the third entry's source is %q, want mirror (its host's bases are not copied)", s)
		}
	}
}
