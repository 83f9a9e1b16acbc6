-- Run once by the postgres image on an empty data volume: one database for MLflow, one for Prefect, one for
-- the router's A/B request log.
CREATE DATABASE mlflow;
CREATE DATABASE prefect;
CREATE DATABASE ab;
