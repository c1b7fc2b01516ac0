package egressproxy

import (
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/naming"
	"pgregory.net/rapid"
)

// k8sLabel draws a Kubernetes DNS-1123 label (a namespace): 1–63 of a–z,
// 0–9, '-', alphanumeric ends. Unlike our names it may contain "--".
func k8sLabel(t *rapid.T, label string) string {
	return rapid.StringMatching(`[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?`).Draw(t, label)
}

// k8sSubdomain draws a Kubernetes DNS-1123 subdomain (an object name):
// dot-separated labels, at most 253 characters.
func k8sSubdomain(t *rapid.T, label string) string {
	n := rapid.IntRange(1, 5).Draw(t, label+"-labels")
	parts := make([]string, n)
	for i := range parts {
		parts[i] = k8sLabel(t, label)
	}
	s := strings.Join(parts, ".")
	if len(s) > 253 {
		s = strings.TrimRight(s[:253], ".-")
	}
	return s
}

// anyString draws arbitrary input, valid for Kubernetes or not (upper case,
// UTF-8, control bytes, empty), which must still give a valid name.
func anyString(t *rapid.T, label string) string {
	return rapid.OneOf(
		rapid.String(),
		rapid.StringMatching(`[-.A-Za-z0-9_]{0,300}`),
		rapid.Just(""),
		rapid.Just("---"),
	).Draw(t, label)
}

var hashSuffix = regexp.MustCompile(`^([a-z0-9-]*-)?[a-z2-7]{10}$`)

func TestNameFromKubernetesValid(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var ns, name string
		if rapid.Bool().Draw(t, "k8s") {
			ns, name = k8sLabel(t, "ns"), k8sSubdomain(t, "name")
		} else {
			ns, name = anyString(t, "ns"), anyString(t, "name")
		}
		got := NameFromKubernetes(ns, name)
		if err := naming.ValidateName("Name", got); err != nil {
			t.Fatalf("NameFromKubernetes(%q, %q) = %q: %v", ns, name, got, err)
		}
		if !hashSuffix.MatchString(got) {
			t.Fatalf("NameFromKubernetes(%q, %q) = %q: no 10-character hash suffix", ns, name, got)
		}
		if again := NameFromKubernetes(ns, name); again != got {
			t.Fatalf("not deterministic: %q then %q", got, again)
		}
		// The readable part is kept where it fits: a Kubernetes pair
		// without "--" or dots whose "ns-name" fits in 52 characters is the
		// prefix as it is.
		if plain := ns + "-" + name; len(plain) <= naming.MaxNameLen-1-nameHashLen && naming.ValidateName("x", plain) == nil {
			if !strings.HasPrefix(got, plain+"-") || len(got) != len(plain)+1+nameHashLen {
				t.Fatalf("NameFromKubernetes(%q, %q) = %q: want %q and the hash", ns, name, got, plain+"-")
			}
		}
	})
}

// TestNameFromKubernetesInjective: no two distinct pairs among many drawn
// ones (including pairs built to share their readable prefix) give one
// name.
func TestNameFromKubernetesInjective(t *testing.T) {
	seen := map[string][2]string{} // across every drawn case: tens of thousands of names
	rapid.Check(t, func(t *rapid.T) {
		add := func(ns, name string) {
			got := NameFromKubernetes(ns, name)
			if prev, ok := seen[got]; ok && prev != [2]string{ns, name} {
				t.Fatalf("collision: %q/%q and %q/%q both give %q", prev[0], prev[1], ns, name, got)
			}
			seen[got] = [2]string{ns, name}
		}
		long := strings.Repeat("x", 60)
		for i := 0; i < 50; i++ {
			ns, name := k8sLabel(t, "ns"), k8sSubdomain(t, "name")
			add(ns, name)
			add(name, ns)
			// Same prefix after cutting: differ only past the 52nd byte.
			add(ns, long+name)
			add(ns, long+name+"0")
			// Same prefix after mapping: '.' and '-' both become '-'.
			add(ns, strings.ReplaceAll(name, ".", "-"))
			add(ns+"-"+name, "x")
		}
	})
	if len(seen) < 5000 {
		t.Fatalf("only %d distinct names drawn; the property needs many", len(seen))
	}
	t.Logf("%d distinct names, no collision", len(seen))
}

func TestNameFromKubernetesExamples(t *testing.T) {
	for _, tc := range []struct{ ns, name, prefix string }{
		{"prod", "web", "prod-web-"},
		{"prod", "web.example.com", "prod-web-example-com-"},
		{"Prod", "Web_1", "prod-web-1-"},
		{"a--b", "c", "a-b-c-"},
		{"", "", ""},
		{"---", "...", ""},
		{strings.Repeat("n", 63), strings.Repeat("a", 253), strings.Repeat("n", 52)},
		{"ns", strings.Repeat("a", 49) + "-b", "ns-" + strings.Repeat("a", 49)}, // a cut never leaves a trailing '-'
	} {
		got := NameFromKubernetes(tc.ns, tc.name)
		if err := naming.ValidateName("Name", got); err != nil {
			t.Errorf("NameFromKubernetes(%q, %q) = %q: %v", tc.ns, tc.name, got, err)
		}
		if !strings.HasPrefix(got, tc.prefix) || len(got) > naming.MaxNameLen || !hashSuffix.MatchString(got) {
			t.Errorf("NameFromKubernetes(%q, %q) = %q, want prefix %q and a hash suffix", tc.ns, tc.name, got, tc.prefix)
		}
	}
	// The inputs are joined unambiguously: these share "a-b-c".
	pairs := [][2]string{{"a-b", "c"}, {"a", "b-c"}, {"a.b", "c"}, {"a", "b.c"}, {"a-b-c", ""}, {"", "a-b-c"}}
	seen := map[string]bool{}
	for _, p := range pairs {
		got := NameFromKubernetes(p[0], p[1])
		if seen[got] {
			t.Errorf("NameFromKubernetes(%q, %q) = %q collides", p[0], p[1], got)
		}
		seen[got] = true
	}
	// Stable across releases: a fixed value (changing it renames every
	// embedder's instances).
	for _, g := range []struct{ ns, name, want string }{
		{"prod", "web", "prod-web-rx2npgvqgs"},
		{"kube-system", "coredns.example", "kube-system-coredns-example-gowoquvh5g"},
	} {
		if got := NameFromKubernetes(g.ns, g.name); got != g.want {
			t.Errorf("NameFromKubernetes(%q, %q) = %q, want %q (the value must never change)", g.ns, g.name, got, g.want)
		}
	}
}

// An operator that runs one proxy per Kubernetes object names the instance
// after the object and uses the object's UID as the instance UID.
func ExampleNameFromKubernetes() {
	fmt.Println(NameFromKubernetes("prod", "web"))
	fmt.Println(NameFromKubernetes("kube-system", "coredns.example"))
	// Output:
	// prod-web-rx2npgvqgs
	// kube-system-coredns-example-gowoquvh5g
}
