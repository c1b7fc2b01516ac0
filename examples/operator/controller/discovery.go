package controller

import (
	"cmp"
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/go-logr/logr"
	discoveryv1 "k8s.io/api/discovery/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// DiscoveryPath is where the operator's metrics port serves every pool's
// ready endpoints as JSON, for tools outside Kubernetes (GET; the query
// parameter namespace narrows it to one namespace).
const DiscoveryPath = "/pools"

// Discovery is what DiscoveryPath answers.
type Discovery struct {
	Pools []PoolEndpoints `json:"pools"`
}

// PoolEndpoints are one pool's ready endpoints, as its EndpointSlices
// list them.
type PoolEndpoints struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Service is the pool's Service (its name), in Namespace.
	Service string `json:"service"`
	// Endpoints are the host:port of its ready (Healthy) children,
	// sorted; a memory entry's loopback proxy as <ip>.localhost (see
	// EndpointAddress).
	Endpoints []string `json:"endpoints"`
}

// DiscoveryHandler serves DiscoveryPath from the EndpointSlices the
// operator wrote, read through r at each request (the manager's
// APIReader: any replica answers, the leader or not). Errors are 503 with
// a generic text; the cause is logged.
func DiscoveryHandler(r client.Reader, log logr.Logger) http.Handler {
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method != http.MethodGet && req.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		ctx, cancel := context.WithTimeout(req.Context(), 10*time.Second)
		defer cancel()
		d, err := discover(ctx, r, req.URL.Query().Get("namespace"))
		if err != nil {
			log.Info("discovery not answered", "err", err)
			http.Error(w, "the pools' endpoints could not be read", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(d)
	})
}

// discover reads the pools' endpoints (in namespace; "": every one).
func discover(ctx context.Context, r client.Reader, namespace string) (Discovery, error) {
	var l discoveryv1.EndpointSliceList
	opts := []client.ListOption{client.MatchingLabels{discoveryv1.LabelManagedBy: ManagedBy}, client.HasLabels{LabelPool}}
	if namespace != "" {
		opts = append(opts, client.InNamespace(namespace))
	}
	if err := r.List(ctx, &l, opts...); err != nil {
		return Discovery{}, err
	}
	pools := map[[2]string]*PoolEndpoints{}
	for _, s := range l.Items {
		k := [2]string{s.Namespace, s.Labels[LabelPool]}
		p := pools[k]
		if p == nil {
			p = &PoolEndpoints{Namespace: k[0], Name: k[1], Service: s.Labels[discoveryv1.LabelServiceName], Endpoints: []string{}}
			pools[k] = p
		}
		if len(s.Ports) == 0 || s.Ports[0].Port == nil {
			continue
		}
		port := strconv.Itoa(int(*s.Ports[0].Port))
		for _, e := range s.Endpoints {
			if e.Conditions.Ready == nil || !*e.Conditions.Ready || len(e.Addresses) == 0 {
				continue
			}
			host := e.Addresses[0]
			if s.AddressType == discoveryv1.AddressTypeIPv6 {
				host = "[" + host + "]"
			}
			p.Endpoints = append(p.Endpoints, host+":"+port)
		}
	}
	d := Discovery{Pools: []PoolEndpoints{}}
	for _, k := range slices.SortedFunc(maps.Keys(pools), func(a, b [2]string) int { return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1])) }) {
		p := pools[k]
		slices.Sort(p.Endpoints)
		d.Pools = append(d.Pools, *p)
	}
	return d, nil
}
