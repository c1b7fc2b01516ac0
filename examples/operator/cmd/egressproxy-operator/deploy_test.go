package main

import (
	"io"
	"net"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/egressproxy/egressproxy/examples/operator/internal/kustomized"
	"github.com/egressproxy/egressproxy/examples/operator/internal/ociimage"
	"github.com/egressproxy/egressproxy/kvm2"
)

// deployment renders config/default and returns its objects, the
// operator's Deployment and its container.
func deployment(t *testing.T) ([]*unstructured.Unstructured, *appsv1.Deployment, *corev1.Container) {
	t.Helper()
	objs, err := kustomized.Render(filepath.Join("..", "..", "config", "default"))
	if err != nil {
		t.Fatal(err)
	}
	d, c, err := kustomized.Operator(objs)
	if err != nil {
		t.Fatal(err)
	}
	return objs, d, c
}

// The Deployment of config/default runs this command, the one the image's
// entrypoint is, with flags it parses: the entries file where the
// ConfigMap is mounted, the Lease in the pod's namespace, the health
// endpoints where the probes look and the metrics where the port is
// named; and the end-to-end test's arguments, derived from the
// Deployment's, parse too.
func TestDeploymentFlags(t *testing.T) {
	objs, d, c := deployment(t)
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("replicas %v, want 2 (one leader, one standby)", d.Spec.Replicas)
	}
	if len(c.Command) != 1 || c.Command[0] != ociimage.Entrypoint {
		t.Errorf("command %q, want the image's entrypoint %s", c.Command, ociimage.Entrypoint)
	}
	if !strings.HasPrefix(c.Image, "egressproxy-operator:") {
		t.Errorf("image %q, want the one make operator-image builds (egressproxy-operator:TAG)", c.Image)
	}
	args := expandEnv(t, c, d.Namespace)
	o, err := parseFlags(args, io.Discard)
	if err != nil {
		t.Fatalf("the Deployment's args %q: %v", args, err)
	}

	// The entries file is the ConfigMap's key, where it is mounted.
	mount, cm := mountOf(t, c, d.Spec.Template.Spec.Volumes, "entries")
	if dir, file := path.Split(o.entries); path.Clean(dir) != mount {
		t.Errorf("--entries=%s is not in the ConfigMap's mount %s", o.entries, mount)
	} else if data := configMapKey(t, objs, cm, file); data == "" {
		t.Errorf("ConfigMap %s has no key %s", cm, file)
	} else {
		var extra struct {
			CredentialsSecrets map[string]string `json:"credentialsSecrets"`
		}
		if _, err := kvm2.ParseEntries([]byte(data), &extra); err != nil {
			t.Errorf("the example entries file does not load: %v", err)
		} else if len(extra.CredentialsSecrets) == 0 {
			t.Errorf("the example entries file names no credentials Secret")
		}
	}
	if o.leaderNS != d.Namespace {
		t.Errorf("--leader-election-namespace=%s, the Deployment is in %s", o.leaderNS, d.Namespace)
	}
	port := func(name string) string {
		for _, p := range c.Ports {
			if p.Name == name {
				return strconv.Itoa(int(p.ContainerPort))
			}
		}
		t.Errorf("no container port named %s", name)
		return ""
	}
	if _, p, _ := net.SplitHostPort(o.probeAddr); p != port("health") {
		t.Errorf("--health-probe-bind-address=%s, the health port is %s", o.probeAddr, port("health"))
	}
	if _, p, _ := net.SplitHostPort(o.metricsAddr); p != port("metrics") {
		t.Errorf("--metrics-bind-address=%s, the metrics port is %s", o.metricsAddr, port("metrics"))
	}
	for probe, want := range map[*corev1.Probe]string{c.LivenessProbe: "/healthz", c.ReadinessProbe: "/readyz"} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != want || probe.HTTPGet.Port.String() != "health" {
			t.Errorf("probe %+v, want GET %s on the health port", probe, want)
		}
	}

	// What the pod may do.
	ps, cs := d.Spec.Template.Spec.SecurityContext, c.SecurityContext
	if ps == nil || ps.RunAsNonRoot == nil || !*ps.RunAsNonRoot || ps.RunAsUser == nil || *ps.RunAsUser == 0 {
		t.Errorf("pod security context %+v: want runAsNonRoot and a non-root runAsUser", ps)
	}
	if cs == nil || cs.ReadOnlyRootFilesystem == nil || !*cs.ReadOnlyRootFilesystem || cs.AllowPrivilegeEscalation == nil || *cs.AllowPrivilegeEscalation {
		t.Errorf("container security context %+v: want a read-only root file system, no privilege escalation", cs)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want CPU and memory requests and limits", c.Resources)
	}
	if d.Spec.Template.Spec.ServiceAccountName != "egressproxy-operator" {
		t.Errorf("service account %q", d.Spec.Template.Spec.ServiceAccountName)
	}

	// The end-to-end test's process: the same args with its own values.
	set := map[string]string{}
	for _, f := range kustomized.ProcessFlags {
		set[f] = "127.0.0.1:1"
	}
	set["entries"], set["leader-election-namespace"] = filepath.Join(t.TempDir(), "entries.yaml"), "elsewhere"
	pargs, err := kustomized.ProcessArgs(&corev1.Container{Args: args}, set, "--kubeconfig=/k", "--health-interval=1s")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := parseFlags(pargs, io.Discard); err != nil {
		t.Errorf("the end-to-end test's args %q: %v", pargs, err)
	}
}

// expandEnv is c's args with $(VAR) replaced as the kubelet does, for the
// variables set from the pod's namespace.
func expandEnv(t *testing.T, c *corev1.Container, namespace string) []string {
	t.Helper()
	var out []string
	for _, a := range c.Args {
		for _, e := range c.Env {
			if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace" {
				a = strings.ReplaceAll(a, "$("+e.Name+")", namespace)
			}
		}
		if strings.Contains(a, "$(") {
			t.Errorf("arg %q uses a variable the pod does not set", a)
		}
		out = append(out, a)
	}
	return out
}

// mountOf is where c mounts the volume named name, and the ConfigMap that
// volume is.
func mountOf(t *testing.T, c *corev1.Container, vols []corev1.Volume, name string) (string, string) {
	t.Helper()
	var cm string
	for _, v := range vols {
		if v.Name == name && v.ConfigMap != nil {
			cm = v.ConfigMap.Name
		}
	}
	for _, m := range c.VolumeMounts {
		if m.Name == name {
			if cm == "" {
				t.Fatalf("volume %s is not a ConfigMap", name)
			}
			return path.Clean(m.MountPath), cm
		}
	}
	t.Fatalf("the container does not mount volume %s", name)
	return "", ""
}

// configMapKey is the data at key of the ConfigMap named name in objs.
func configMapKey(t *testing.T, objs []*unstructured.Unstructured, name, key string) string {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == "ConfigMap" && o.GetName() == name {
			v, _, _ := unstructured.NestedString(o.Object, "data", key)
			return v
		}
	}
	t.Fatalf("no ConfigMap %s among the objects", name)
	return ""
}
