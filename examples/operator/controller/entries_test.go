package controller

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/kvm2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
)

// LoadEntries reads the file with kvm2.ParseEntries: an entry without
// credentials parses (they come from the Secret), and a problem is named by
// its key path (with the entry's index) and line; the Secret's values fill
// the credentials.
func TestLoadEntries(t *testing.T) {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "sys", Name: "hv1-ssh"},
		Data: map[string][]byte{
			SecretKeySSHPrivateKey: []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n"),
			SecretKeyKnownHosts:    []byte("hv1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"),
		}}
	r := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(sec).Build()
	const entry = "credentialsSecrets:\n  hv1: sys/hv1-ssh\nentries:\n- {entry: hv1, owner: op, address: 'hv1:22', user: root, pool: default%s}\n"
	load := func(extra string) ([]kvm2.Config, error) {
		return LoadEntries(context.Background(), r, []byte(strings.Replace(entry, "%s", extra, 1)))
	}
	cfgs, err := load("")
	if err != nil {
		t.Fatalf("LoadEntries = %v", err)
	}
	if len(cfgs) != 1 || cfgs[0].Entry != "hv1" || len(cfgs[0].Key) == 0 || len(cfgs[0].KnownHosts) == 0 {
		t.Fatalf("LoadEntries = %+v, want hv1 with Key and KnownHosts from the Secret", cfgs)
	}
	// The image cache's claim timeout is set per entry (README: keep it
	// near the lease duration), with kvm2's lower bound.
	cfgs, err = load(", claimTimeout: 15s")
	if err != nil || len(cfgs) != 1 || cfgs[0].ClaimTimeout != 15*time.Second {
		t.Fatalf("LoadEntries with claimTimeout 15s = %+v, %v", cfgs, err)
	}
	for _, tt := range []struct {
		name, extra string
		want        []string
	}{
		{"bare-number duration", ", callTimeout: 30", []string{"line 4: invalid entries[0].callTimeout", "nanoseconds"}},
		{"claim timeout too short", ", claimTimeout: 2s", []string{"line 4: invalid entries[0].claimTimeout", "at least 10s"}},
		{"no Secret for an entry", "}\n- {entry: hv2, owner: op, address: 'hv2:22', user: root, pool: default", []string{"invalid credentialsSecrets: names no Secret for entries[1] (hv2)"}},
	} {
		_, err := load(tt.extra)
		for _, w := range tt.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%s: LoadEntries = %v, want an error saying %q", tt.name, err, w)
			}
		}
	}
	const badSecrets = "credentialsSecrets:\n  hv1: hv1-ssh\n  hv9: sys/x\nentries:\n- {entry: hv1, owner: op, address: 'hv1:22', user: root, pool: default}\n"
	_, err = LoadEntries(context.Background(), r, []byte(badSecrets))
	for _, w := range []string{`invalid credentialsSecrets.hv1 "hv1-ssh": want namespace/name`, "invalid credentialsSecrets.hv9: is not the name of an entry"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("LoadEntries with bad credentialsSecrets = %v, want an error saying %q", err, w)
		}
	}
}

// The entries file's labels are each entry's, checked as Kubernetes
// checks an object's labels, every problem named by its key path.
func TestLoadEntryLabels(t *testing.T) {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "sys", Name: "hv1-ssh"},
		Data: map[string][]byte{SecretKeySSHPrivateKey: []byte("k"), SecretKeyKnownHosts: []byte("kh")}}
	r := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(sec).Build()
	const file = "credentialsSecrets:\n  hv1: sys/hv1-ssh\n%s\nentries:\n- {entry: hv1, owner: op, address: 'hv1:22', user: root, pool: default}\n"
	load := func(labels string) ([]kvm2.Config, map[string]map[string]string, error) {
		return LoadEntriesWithLabels(context.Background(), r, []byte(strings.Replace(file, "%s", labels, 1)))
	}
	_, labels, err := load("labels:\n  hv1: {zone: a, egressproxy.dev/rack: r-1}")
	if err != nil {
		t.Fatalf("LoadEntriesWithLabels = %v", err)
	}
	if want := map[string]string{"zone": "a", "egressproxy.dev/rack": "r-1"}; !maps.Equal(labels["hv1"], want) || len(labels) != 1 {
		t.Errorf("labels = %v, want hv1: %v", labels, want)
	}
	if _, labels, err := load(""); err != nil || len(labels) != 0 {
		t.Errorf("no labels: %v, %v; want none and no error", labels, err)
	}
	_, _, err = load("labels:\n  hv1: {'bad key': a, zone: 'not a value!'}\n  hv9: {zone: b}")
	for _, w := range []string{
		`invalid labels.hv1["bad key"]: is not a label key`,
		`invalid labels.hv1.zone "not a value!": is not a label value`,
		"invalid labels.hv9: is not the name of an entry",
	} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("bad labels: LoadEntriesWithLabels = %v, want an error saying %q", err, w)
		}
	}
	var fe *egressproxy.FieldError
	if !errors.As(err, &fe) {
		t.Errorf("bad labels: %v holds no FieldError", err)
	}
}
