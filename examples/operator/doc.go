// Package operator will hold an egress-proxy operator built on the
// egressproxy library and sigs.k8s.io/controller-runtime (issue 17). It is
// its own Go module, so the library's module gains no Kubernetes
// dependency; it uses the library through a replace of the repository root.
//
// For now it holds the proof that a real control plane runs here: the test
// in controlplane_test.go starts kube-apiserver and etcd with
// controller-runtime's envtest and round-trips a ConfigMap through them.
// The binaries come from scripts/kubestack:
//
//	scripts/kubestack build                  # once per machine (minutes)
//	eval "$(scripts/kubestack env)"          # sets KUBEBUILDER_ASSETS
//	cd examples/operator && go test -count=1 ./...
//
// Without KUBEBUILDER_ASSETS the test asks `scripts/kubestack env` itself;
// when no control plane is built it skips, naming the command to build one,
// except under CI=true, where it fails.
package operator
