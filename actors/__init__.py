"""The Ray layer: thin actors around raytool objects, the actor-graph composition and the driver."""
