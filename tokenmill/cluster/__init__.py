"""Scale-out on Ray Serve: `tokenmill cluster serve` (the `tokenmill[cluster]` extra).

  engine.py      ClusterEngine: the EngineClient the ingress's server runs on
  models.py      ClusterModels: several models, each its own Ray Serve application
  replica.py     EngineReplica: the Ray Serve deployment holding one engine
  ray_router.py  TokenmillRouter: our policies at Ray Serve's request-router hook
  routing.py     the policies themselves (prefix affinity with a load guard, round
                 robin, power of two choices), free of Ray
"""
