package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
)

// LoadEntries reads each entry's config with kvm2.ParseConfig: a config
// without credentials parses (they come from the Secret), and a problem is
// named by entry, key and rule; the Secret's values fill the credentials.
func TestLoadEntries(t *testing.T) {
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "sys", Name: "hv1-ssh"},
		Data: map[string][]byte{
			SecretKeySSHPrivateKey: []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n"),
			SecretKeyKnownHosts:    []byte("hv1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"),
		}}
	r := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(sec).Build()
	const entry = "entries:\n- credentialsSecret: sys/hv1-ssh\n  config: {entry: hv1, owner: op, address: 'hv1:22', user: root, pool: default%s}\n"
	cfgs, err := LoadEntries(context.Background(), r, []byte(strings.Replace(entry, "%s", "", 1)))
	if err != nil {
		t.Fatalf("LoadEntries = %v", err)
	}
	if len(cfgs) != 1 || cfgs[0].Entry != "hv1" || len(cfgs[0].Key) == 0 || len(cfgs[0].KnownHosts) == 0 {
		t.Fatalf("LoadEntries = %+v, want hv1 with Key and KnownHosts from the Secret", cfgs)
	}
	_, err = LoadEntries(context.Background(), r, []byte(strings.Replace(entry, "%s", ", callTimeout: 30", 1)))
	if err == nil || !strings.Contains(err.Error(), "entries[0].config") || !strings.Contains(err.Error(), "callTimeout") || !strings.Contains(err.Error(), "nanoseconds") {
		t.Fatalf("LoadEntries with a bare-number duration = %v, want an error naming entries[0].config, callTimeout and the rule", err)
	}
	// The image cache's claim timeout is set per entry (README: keep it
	// near the lease duration), with kvm2's lower bound.
	cfgs, err = LoadEntries(context.Background(), r, []byte(strings.Replace(entry, "%s", ", claimTimeout: 15s", 1)))
	if err != nil || len(cfgs) != 1 || cfgs[0].ClaimTimeout != 15*time.Second {
		t.Fatalf("LoadEntries with claimTimeout 15s = %+v, %v", cfgs, err)
	}
	_, err = LoadEntries(context.Background(), r, []byte(strings.Replace(entry, "%s", ", claimTimeout: 2s", 1)))
	if err == nil || !strings.Contains(err.Error(), "entries[0].config") || !strings.Contains(err.Error(), "ClaimTimeout") || !strings.Contains(err.Error(), "at least 10s") {
		t.Fatalf("LoadEntries with claimTimeout 2s = %v, want an error naming entries[0].config, ClaimTimeout and its minimum", err)
	}
}
