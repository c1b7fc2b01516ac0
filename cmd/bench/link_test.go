package main

import (
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
)

const pprofTop = `File: bench
Type: cpu
Time: 2026-12-02 14:00:00 UTC
Duration: 10.20s, Total samples = 5s (49.02%)
Showing nodes accounting for 4.50s, 90.00% of 5s total
      flat  flat%   sum%        cum   cum%
     2.00s 40.00% 40.00%      2.00s 40.00%  crypto/internal/fips140/aes/gcm.gcmAesEnc
     1.00s 20.00% 60.00%      1.00s 20.00%  crypto/internal/fips140/sha256.blockSHANI
     0.50s 10.00% 70.00%      0.50s 10.00%  runtime.memmove
     500ms 10.00% 80.00%      3.00s 60.00%  syscall.Syscall6
     250ms  5.00% 85.00%      250ms  5.00%  github.com/digitalocean/go-libvirt/internal/go-xdr/xdr2.(*Decoder).DecodeUint
     250ms  5.00% 90.00%      250ms  5.00%  runtime.scanobject
`

func TestParseTop(t *testing.T) {
	p, err := parseTop(pprofTop)
	if err != nil {
		t.Fatal(err)
	}
	if p.duration != 10.2 || p.samples != 5 {
		t.Errorf("duration, samples = %v, %v; want 10.2, 5", p.duration, p.samples)
	}
	want := map[string]float64{"SSH cipher and MAC": 2, "hashing (sha256)": 1, "copies (memmove, buffers)": 0.5, "syscalls and network": 0.5, "libvirt RPC (go-libvirt, XDR)": 0.25, "Go runtime (GC, scheduler)": 0.25}
	for k, v := range want {
		if p.groups[k] != v {
			t.Errorf("group %q = %v, want %v (all: %v)", k, p.groups[k], v, p.groups)
		}
	}
	if g := p.groupsLine(); !strings.HasPrefix(g, "SSH cipher and MAC 40%, hashing (sha256) 20%") {
		t.Errorf("groupsLine = %q", g)
	}
	if p.top[0].name != "crypto/internal/fips140/aes/gcm.gcmAesEnc" || p.top[3].cum != 3 {
		t.Errorf("top = %+v", p.top)
	}
	if _, err := parseTop("nothing here"); err == nil {
		t.Error("parseTop of no samples: no error")
	}
}

func TestParseLabEnv(t *testing.T) {
	out := `export EGRESSPROXY_LAB_DIR=/tmp/x/lab
export EGRESSPROXY_LAB_HOSTS=1
export EGRESSPROXY_LAB_1_LINK=egplab1
export EGRESSPROXY_LAB_1_SSH_ADDR=10.251.1.2:22022
export EGRESSPROXY_LAB_1_SSH_USER=root
export EGRESSPROXY_LAB_1_SSH_KEY=/tmp/x/lab/h1/stack/ssh/id_ed25519
export EGRESSPROXY_LAB_1_KNOWN_HOSTS=/tmp/x/lab/h1/known_hosts
export EGRESSPROXY_LAB_1_LIBVIRT_SOCKET=/tmp/x/lab/h1/stack/libvirt/libvirt-sock
export EGRESSPROXY_LAB_1_LIBVIRT_URI=qemu:///system
export EGRESSPROXY_LAB_1_POOL=egressproxy-test
export EGRESSPROXY_LAB_1_POOL_PATH=/tmp/x/lab/h1/stack/pool
export EGRESSPROXY_LAB_1_NETWORK=egressproxy-lab
export EGRESSPROXY_LAB_1_STACK_DIR=/tmp/x/lab/h1/stack
`
	hs, err := parseLabEnv(out, "/d")
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || hs[0].link != "egplab1" || hs[0].env.SSHAddr != "10.251.1.2:22022" || hs[0].env.Dir != "/d" || hs[0].network != "egressproxy-lab" {
		t.Errorf("hosts = %+v", hs)
	}
	if _, err := parseLabEnv(strings.Replace(out, "export EGRESSPROXY_LAB_1_POOL=egressproxy-test\n", "", 1), "/d"); err == nil || !strings.Contains(err.Error(), "EGRESSPROXY_LAB_1_POOL") {
		t.Errorf("missing pool: err = %v", err)
	}
}

func TestParseLabRates(t *testing.T) {
	rs, err := parseLabRates("1gbit:1024, 100mbit:256")
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || rs[0].bits != 1e9 || rs[0].imageMiB != 1024 || rs[1].rate != "100mbit" || rs[1].bits != 1e8 {
		t.Errorf("rates = %+v", rs)
	}
	for _, bad := range []string{"", "1gbit", "1gbit:x", "fast:10", "1gbit:0"} {
		if _, err := parseLabRates(bad); err == nil {
			t.Errorf("parseLabRates(%q): no error", bad)
		}
	}
}

func labFixture() *labRate {
	return &labRate{
		spec: labRateSpec{rate: "1gbit", bits: 1e9, imageMiB: 1024}, image: benchutil.Image{Size: 1 << 30, SHA256: strings.Repeat("b", 64)},
		libUpload: []float64{110, 112, 111}, libVerify: []float64{100, 100, 100}, libWhole: []float64{90, 92, 91},
		ssh: []float64{115, 115, 115}, pipe: []float64{57, 57, 57}, pipeUp: []float64{114, 114, 114}, pipeDown: []float64{114, 114, 114},
		wholeVsSSH: []float64{0.78, 0.80, 0.79}, wholeVsPipe: []float64{1.58, 1.61, 1.60}, upVsSSH: []float64{0.96, 0.97, 0.96},
		rssKiB: []float64{30000, 31000, 32000}, multiRSSKiB: []float64{70000, 71000, 72000}, multiWallS: []float64{40, 41, 42}, multiHosts: 4,
		libTx: []float64{0.8, 0.8, 0.8}, libRx: []float64{0.75, 0.75, 0.75}, sshTx: []float64{0.94, 0.94, 0.94}, libSeconds: []float64{11.8, 11.7, 11.9},
		creates: &createsResult{hosts: 4, per: 5, one: []float64{30, 31, 32}, many: []float64{36, 37, 38}, manyVsOne: []float64{1.2, 1.19, 1.19},
			runsOne: []createsRun{
				{busy: 0.5, iowait: 0.01, cpu: 4, first: []float64{27.5}, last: []float64{30}},
				{busy: 0.52, iowait: 0.02, cpu: 4.1, first: []float64{28}, last: []float64{31}},
				{busy: 0.51, iowait: 0.01, cpu: 4.2, first: []float64{29}, last: []float64{32}},
			},
			runsMany: []createsRun{
				{busy: 0.97, iowait: 0.02, cpu: 16, first: []float64{33, 33.2, 34, 33.5}, last: []float64{35.1, 35.5, 36, 35.8}},
				{busy: 0.98, iowait: 0.01, cpu: 16.5, first: []float64{34, 34.1, 34.2, 34}, last: []float64{36.2, 37, 36.5, 36.9}},
				{busy: 0.99, iowait: 0.03, cpu: 17, first: []float64{35, 35.5, 35.2, 35.1}, last: []float64{38, 37.5, 37.9, 37.1}},
			}},
	}
}

func TestRenderLabAndRTT(t *testing.T) {
	r := &report{opts: options{runs: 3, labRuns: 3, command: "make bench"},
		lab: &labResult{hosts: 4, dir: "/s/lab", rates: []*labRate{labFixture()}},
		rtt: &rttResult{rtt: 50 * time.Millisecond, n: 100,
			hit:   rttOps{direct: stats(10, 100), remote: stats(10, 575), rounds: []float64{9, 9, 10}},
			cold:  rttOps{direct: stats(44, 300), remote: stats(44, 2800), rounds: []float64{40, 41, 40}},
			list:  rttOps{direct: stats(4, 60), remote: stats(4, 300), rounds: []float64{5, 5, 5}},
			seqMS: []float64{10300, 10400, 10200}, seqRPCs: 201},
	}
	out := r.render()
	for _, want := range []string{
		"| library whole cold fetch / cat \\| ssh | 0.79× | 0.78 / 0.80 / 0.79 | 3% | ≥ 0.85× | **MISSED** |",
		"| library whole cold fetch / virsh pipeline | 1.60× | 1.58 / 1.61 / 1.60 | 2% | ≥ 1.6× | **met** |",
		"| library upload phase / cat \\| ssh | 0.96× | 0.96 / 0.97 / 0.96 | 1% | ≥ 0.95× | **met** |",
		"median **30.3 MiB** (target ≤ 32 MiB: **met**)",
		"median **69.3 MiB** (target ≤ 64 MiB: **MISSED**)",
		"Reading (generated): where the time goes", "80% / 80% / 80% of 1gbit up",
		"median **1.19×**", "target ≤ 1.3×: **met**",
		"1 host × 5: its first Create returned (the cold fetch done) at 27.5 / 28.0 / 29.0 s, its last at 30.0 / 31.0 / 32.0 s (per run).",
		"last at 35.1 / 35.5 / 36.0 / 35.8; 36.2 / 37.0 / 36.5 / 36.9; 38.0 / 37.5 / 37.9 / 37.1 s (per run): the hosts finish within 2% of the run's time of each other",
		"50 / 52 / 51% busy and 1 / 2 / 1% waiting for I/O during 1 host × 5, 97 / 98 / 99% busy and 2 / 1 / 3% waiting during 4 hosts × 5",
		"| Create, cache hit (starts the domain) | 10 | 100 | 575 | 575 / 575 / 575 | 9 (9 / 9 / 10) | 9.5 | ≤ 10 RTT | **met** |",
		"≤ 25 RTT + transfer | **MISSED** |",
		"| List of 100 (powered off) | 4 | 60 | 300 |",
		"≤ 0.5 s | **met** |",
		"| List of 100 at 50 ms RTT (sequential: 10.30 s) | 0.30 s, 4 RPCs, 5 round trips | ≤ 0.5 s | **met** |",
		"| library whole cold fetch / cat \\| ssh, 1gbit link | 0.79× (0.78 / 0.80 / 0.79) | ≥ 0.85× | **MISSED** |",
		"| 4 hosts × 5 concurrent cold Creates vs 1 × 5, 1gbit, 1024 MiB | 1.19× (37.0 vs 31.0 s) | ≤ 1.3× | **met** |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if t.Failed() {
		t.Log(out)
	}
}

func TestMergeReports(t *testing.T) {
	old := "# Benchmarks\n\n## Command\n\nold cmd\nRun 2026-11-30 10:00 – 10:40 UTC.\n\n## 1. Image upload\n\nold upload\n\n## 4. Health probes\n\nold health\n\n## 6. On the lab\n\nold lab\n\n## Summary\n\n| figure | median | target | reading |\n| --- | --- | --- | --- |\n| upload phase vs virsh vol-upload | 1.03× | ≥ 1.2× | **MISSED** |\n| List of 100 at 50 ms RTT | 9 s | ≤ 0.5 s | **MISSED** |\n" + analysisMarker + "old reading\n"
	nw := "# Benchmarks\n\n## Command\n\nnew cmd\n\n## 6. On the lab\n\nnew lab\n\n## 7. Round-trip time\n\nnew rtt\n\n## Summary\n\n| figure | median | target | reading |\n| --- | --- | --- | --- |\n| List of 100 at 50 ms RTT | 0.3 s | ≤ 0.5 s | **met** |\n" + analysisMarker + "new reading\n"
	got := mergeReports(old, nw)
	order := []string{"## Command\n\nnew cmd", "sections 1., 4. kept from the earlier run of 2026-11-30 10:00–10:40 UTC", "## 1. Image upload\n\nold upload", "Section kept from the earlier run", "## 4. Health probes\n\nold health", "## 6. On the lab\n\nnew lab", "## 7. Round-trip time", "## Summary",
		"| List of 100 at 50 ms RTT | 0.3 s | ≤ 0.5 s | **met** |\n| upload phase vs virsh vol-upload | 1.03× | ≥ 1.2× | **MISSED** *(earlier run, 2026-11-30 10:00–10:40 UTC)* |", analysisMarker + "new reading\n"}
	at := 0
	for _, w := range order {
		i := strings.Index(got[at:], w)
		if i < 0 {
			t.Fatalf("merged report lacks %q after offset %d:\n%s", w, at, got)
		}
		at += i + len(w)
	}
	for _, no := range []string{"old lab", "old cmd", "old reading", "| 9 s |"} {
		if strings.Contains(got, no) {
			t.Errorf("merged report keeps %q:\n%s", no, got)
		}
	}
}
