package controller

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/internal/memhost"
	"github.com/egressproxy/egressproxy/memprovider"
)

// LoadEntriesFile: memory entries alone, or beside kvm2 entries (whose
// errors keep the file's line numbers), each problem a FieldError naming
// its key path and line; a memory entry may not take a kvm2 entry's name.
func TestLoadEntriesFile(t *testing.T) {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "sys", Name: "hv1-ssh"},
		Data: map[string][]byte{
			SecretKeySSHPrivateKey: []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n"),
			SecretKeyKnownHosts:    []byte("hv1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"),
		}}
	r := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(sec).Build()
	ctx := context.Background()

	// Memory entries only.
	cfgs, mems, _, err := LoadEntriesFile(ctx, r, []byte("memoryEntries:\n- {entry: m1, callDelay: 50ms}\n- entry: m2\n  provisionDelay: 2s\n- {entry: m3, proxyAddress: '::ffff:192.0.2.1'}\n- {entry: m4, endpoint: 'http://127.0.0.1:7070'}\n"))
	if err != nil {
		t.Fatalf("memory entries only: %v", err)
	}
	want := []MemoryEntry{{Entry: "m1", CallDelay: 50 * time.Millisecond}, {Entry: "m2", ProvisionDelay: 2 * time.Second},
		{Entry: "m3", ProxyAddress: netip.MustParseAddr("192.0.2.1")}, {Entry: "m4", Endpoint: "http://127.0.0.1:7070"}}
	if len(cfgs) != 0 || !slices.Equal(mems, want) {
		t.Fatalf("memory entries only = %+v, %+v; want no kvm2 entries and %+v", cfgs, mems, want)
	}

	// Beside a kvm2 entry, before and after it in the file.
	const kvm = "credentialsSecrets:\n  hv1: sys/hv1-ssh\nentries:\n- {entry: hv1, owner: op, address: 'hv1:22', user: root, pool: default%s}\n"
	for _, data := range []string{
		"memoryEntries:\n- {entry: m1, callDelay: 50ms}\n" + strings.Replace(kvm, "%s", "", 1),
		strings.Replace(kvm, "%s", "", 1) + "memoryEntries:\n- {entry: m1, callDelay: 50ms}\n",
	} {
		cfgs, mems, _, err := LoadEntriesFile(ctx, r, []byte(data))
		if err != nil || len(cfgs) != 1 || cfgs[0].Entry != "hv1" || len(cfgs[0].Key) == 0 || len(mems) != 1 || mems[0].Entry != "m1" {
			t.Errorf("both kinds:\n%s= %+v, %+v, %v; want hv1 with its credentials and m1", data, cfgs, mems, err)
		}
	}
	// Labels may name either kind, in a file with both or with memory
	// entries only; a name of neither is refused.
	for _, data := range []string{
		"memoryEntries:\n- {entry: m1}\nlabels:\n  m1: {zone: a}\n  hv1: {zone: b}\n" + strings.Replace(kvm, "%s", "", 1),
		"memoryEntries:\n- {entry: m1}\nlabels:\n  m1: {zone: a}\n",
	} {
		_, _, labels, err := LoadEntriesFile(ctx, r, []byte(data))
		if err != nil || labels["m1"]["zone"] != "a" || (strings.Contains(data, "hv1:") && labels["hv1"]["zone"] != "b") {
			t.Errorf("labels:\n%s= %v, %v; want m1's (and hv1's) labels", data, labels, err)
		}
	}
	for _, data := range []string{
		"memoryEntries:\n- {entry: m1}\nlabels:\n  m2: {zone: a}\n",
		"memoryEntries:\n- {entry: m1}\nlabels:\n  m2: {zone: a}\n" + strings.Replace(kvm, "%s", "", 1),
	} {
		if _, _, _, err := LoadEntriesFile(ctx, r, []byte(data)); err == nil || !strings.Contains(err.Error(), "invalid labels.m2: is not the name of an entry") {
			t.Errorf("labels of no entry:\n%s= %v; want labels.m2 refused", data, err)
		}
	}
	if _, _, _, err := LoadEntriesFile(ctx, r, []byte("memoryEntries:\n- {entry: m1}\nlabels:\n  m1: {zone: \"not a value!\"}\n")); err == nil || !strings.Contains(err.Error(), "labels.m1.zone") {
		t.Errorf("a bad label value of a memory entry: %v; want labels.m1.zone named", err)
	}

	// Without memoryEntries it is LoadEntries.
	if cfgs, mems, _, err := LoadEntriesFile(ctx, r, []byte(strings.Replace(kvm, "%s", "", 1))); err != nil || len(cfgs) != 1 || mems != nil {
		t.Errorf("kvm2 entries only = %+v, %+v, %v", cfgs, mems, err)
	}

	for _, tt := range []struct {
		name, data string
		want       []string
	}{
		{"bare-number delay", "memoryEntries:\n- {entry: m1, callDelay: 50}\n",
			[]string{`line 2: invalid memoryEntries[0].callDelay "50": must be a duration with its unit`}},
		{"negative delay", "memoryEntries:\n- {entry: m1}\n- {entry: m2, provisionDelay: -1s}\n",
			[]string{`line 3: invalid memoryEntries[1].provisionDelay "-1s": must not be negative`}},
		{"proxy address no IP", "memoryEntries:\n- {entry: m1, proxyAddress: 'host.example'}\n",
			[]string{`line 2: invalid memoryEntries[0].proxyAddress "host.example": must be an IP address`}},
		{"proxy address unspecified", "memoryEntries:\n- {entry: m1, proxyAddress: 0.0.0.0}\n- {entry: m2, proxyAddress: 'ff02::1'}\n",
			[]string{`line 2: invalid memoryEntries[0].proxyAddress "0.0.0.0": must be an address of the host, not unspecified`,
				`line 3: invalid memoryEntries[1].proxyAddress "ff02::1": must be an address of the host, not unspecified or multicast`}},
		{"endpoint beyond loopback", "memoryEntries:\n- {entry: m1}\n- {entry: m2, endpoint: 'http://192.0.2.1:7070'}\n- {entry: m3, endpoint: '127.0.0.1:7070'}\n",
			[]string{`line 3: invalid memoryEntries[1].endpoint "http://192.0.2.1:7070": must be http://HOST:PORT of a memory host with a loopback HOST`,
				`line 4: invalid memoryEntries[2].endpoint "127.0.0.1:7070": must be http://HOST:PORT`}},
		{"delays beside an endpoint", "memoryEntries:\n- entry: m1\n  endpoint: http://127.0.0.1:7070\n  callDelay: 50ms\n  provisionDelay: 1s\n",
			[]string{"line 4: invalid memoryEntries[0].callDelay: must not be given beside endpoint: the memory host waits its own delays",
				"line 5: invalid memoryEntries[0].provisionDelay: must not be given beside endpoint"}},
		{"proxy address beside an endpoint", "memoryEntries:\n- entry: m1\n  endpoint: http://127.0.0.1:7070\n  proxyAddress: 192.0.2.1\n",
			[]string{"line 4: invalid memoryEntries[0].proxyAddress: must not be given beside endpoint: the memory host's proxies listen where it serves them"}},
		{"unknown key", "memoryEntries:\n- {entry: m1, address: 'x:22'}\n",
			[]string{"line 2: invalid memoryEntries[0].address: is not a key of a memory entry"}},
		{"bad and missing names", "memoryEntries:\n- {entry: M_1}\n- {callDelay: 1ms}\n- {entry: a--b}\n",
			[]string{`line 2: invalid memoryEntries[0].entry "M_1": must be a lowercase DNS label`,
				"line 3: invalid memoryEntries[1].entry: is required", `line 4: invalid memoryEntries[2].entry "a--b": must not contain "--"`}},
		{"two memory entries of one name", "memoryEntries:\n- {entry: m1}\n- {entry: m1}\n",
			[]string{`line 3: invalid memoryEntries[1].entry "m1": is also the name of memoryEntries[0]`}},
		{"not a list", "memoryEntries: {entry: m1}\n", []string{"line 1: invalid memoryEntries: must be a list"}},
		{"empty", "memoryEntries: []\n", []string{"line 1: invalid memoryEntries: is empty"}},
		{"given twice", "memoryEntries:\n- {entry: m1}\nmemoryEntries:\n- {entry: m2}\n",
			[]string{"line 3: invalid memoryEntries: is given twice (first on line 1)"}},
		{"flow-style file", "{memoryEntries: [{entry: m1}]}\n", []string{"line 1: invalid memoryEntries: needs a file in block style"}},
		{"a kvm2 entry's name", "memoryEntries:\n- {entry: m1}\n- {entry: hv1, callDelay: 5ms}\n" + strings.Replace(kvm, "%s", "", 1),
			[]string{`line 3: invalid memoryEntries[1].entry "hv1": is also the name of entries[0]`}},
		// The kvm2 entry's problem keeps its own line (6: after the
		// blanked memory entries), reported beside the memory entries'.
		{"problems of both kinds", "memoryEntries:\n- {entry: m1, callDelay: 5}\n" + strings.Replace(kvm, "%s", ", callTimeout: 30", 1),
			[]string{`line 2: invalid memoryEntries[0].callDelay "5"`, "line 6: invalid entries[0].callTimeout"}},
	} {
		_, _, _, err := LoadEntriesFile(ctx, r, []byte(tt.data))
		for _, w := range tt.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%s: LoadEntriesFile = %v, want an error saying %q", tt.name, err, w)
			}
		}
		if err != nil && strings.Contains(tt.data, "memoryEntries:\n") {
			var fe *egressproxy.FieldError
			if !errors.As(err, &fe) {
				t.Errorf("%s: %v has no FieldError", tt.name, err)
			}
		}
	}
}

// OpenMemoryEntries opens memprovider clients that serve real loopback
// proxies and wait their call delay; a name already open is refused.
func TestOpenMemoryEntries(t *testing.T) {
	clients := map[string]*egressproxy.Client{}
	if err := OpenMemoryEntries([]MemoryEntry{{Entry: "m1", CallDelay: 30 * time.Millisecond}, {Entry: "m2"}}, MemoryOptions{}, clients); err != nil {
		t.Fatal(err)
	}
	defer CloseEntries(clients)
	ctx := context.Background()
	t0 := time.Now()
	inst, err := clients["m1"].Create(ctx, egressproxy.Spec{Name: "ep-m1-a", UID: "uid-a"})
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t0); took < 30*time.Millisecond {
		t.Errorf("Create on m1 took %v, want at least its 30ms call delay", took)
	}
	if inst.IP != "127.0.0.1" || inst.Port == 0 {
		t.Errorf("m1's instance is at %s:%d, want a served loopback proxy", inst.IP, inst.Port)
	}
	if err := OpenMemoryEntries([]MemoryEntry{{Entry: "m2"}}, MemoryOptions{}, clients); err == nil {
		t.Error("OpenMemoryEntries of an open name succeeded")
	}
	// A proxy address (127.0.0.2: the host's, not the default).
	if err := OpenMemoryEntries([]MemoryEntry{{Entry: "m3", ProxyAddress: netip.MustParseAddr("127.0.0.2")}}, MemoryOptions{}, clients); err != nil {
		t.Fatal(err)
	}
	inst, err = clients["m3"].Create(ctx, egressproxy.Spec{Name: "ep-m3-a", UID: "uid-a3"})
	if err != nil || inst.IP != "127.0.0.2" || inst.Port == 0 {
		t.Errorf("m3's instance: %+v, %v; want a proxy served on 127.0.0.2", inst, err)
	}
}

// A memory entry with an endpoint is the memory host's entry of its name:
// a VM one replica creates there is found by another replica's client,
// and outlives the first replica's clients.
func TestOpenMemoryEntriesOnAHost(t *testing.T) {
	host, err := memhost.Serve("127.0.0.1:0", []memprovider.Options{{Entry: "m1", ServeProxies: true, CallDelay: 30 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	mems := []MemoryEntry{{Entry: "m1", Endpoint: host.URL()}}
	leader := map[string]*egressproxy.Client{}
	if err := OpenMemoryEntries(mems, MemoryOptions{}, leader); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	t0 := time.Now()
	inst, err := leader["m1"].Create(ctx, egressproxy.Spec{Name: "ep-m1-a", UID: "uid-a"})
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(t0); took < 30*time.Millisecond {
		t.Errorf("Create took %v, want at least the host's 30ms call delay", took)
	}
	if inst.IP != "127.0.0.1" || inst.Port == 0 {
		t.Errorf("the instance is at %s:%d, want a served loopback proxy", inst.IP, inst.Port)
	}
	CloseEntries(leader)
	standby := map[string]*egressproxy.Client{}
	if err := OpenMemoryEntries(mems, MemoryOptions{}, standby); err != nil {
		t.Fatal(err)
	}
	defer CloseEntries(standby)
	if got, err := standby["m1"].Get(ctx, inst.Ref); err != nil || got.Address() != inst.Address() {
		t.Errorf("the standby's Get = %+v, %v; want the leader's VM at %s", got, err, inst.Address())
	}
}
